"""The gateway's calls: a checked request -> a session's plan -> the batcher -> the recorded
turn -> the OpenAI response (:class:`Gateway`; HTTP is :mod:`rlflow.gateway.server`).

An assistant turn's text is the sampled ids without the trailing end-of-turn id, decoded
with special tokens kept (:meth:`rlflow.envs.chat.ChatRenderer.assistant_text`); a thinking
model's reasoning (``data.reasoning_parser``) is returned apart as ``reasoning_content``; the
answer's tool calls (``gateway.tool_parser``, :mod:`rlflow.gateway.tool_calls`) become
``tool_calls`` (finish reason "tool_calls"), the text before them ``content``.
"""

from __future__ import annotations

import secrets
from typing import Callable, Optional

from rlflow.gateway import openai_api as api
from rlflow.gateway.sessions import GatewayError, Plan, SessionStore, Trajectory
from rlflow.gateway.tool_calls import get_parser, openai_tool_calls

#: ``Trajectory.tools_key`` of the token-level trajectories of ``/v1/completions`` calls.
TOKENS_KEY = "<completions: token ids>"


class Gateway:
    """Sessions and calls (thread-safe; one call per session at a time).

    Args:
      store: the :class:`SessionStore` (its renderer has the tokenizer).
      calls: a :class:`rlflow.gateway.calls.CallQueue` (or anything with
        ``generate(prompt_ids, n, sampling, timeout_s) -> [Completion]``).
      sampling: the run's :class:`rlflow.sampler.sampling.SamplingParams`; each call uses its
        temperature, top-k and top-p, its own seed and ``max_tokens``.
      stop_ids: the run's stop ids (the end-of-turn ids are added).
      tool_parser: ``gateway.tool_parser`` name.
      reasoning: ``data.reasoning_parser`` splitter or None.
      call_timeout_s: seconds a call waits for the batcher (504 past it).
      max_n: most choices per call.
      model_name: the ``model`` the responses name.
      on_end: called with a session when it ends, fails or expires (the rollouts).
    """

    def __init__(self, store: SessionStore, calls, sampling, *, stop_ids=(),
                 tool_parser: str = "hermes", reasoning=None, call_timeout_s: float = 300.0,
                 max_n: int = 8, model_name: str = "rlflow-policy",
                 on_end: Optional[Callable] = None):
        self.store, self.calls, self.sampling = store, calls, sampling
        self.renderer = store.renderer
        self.tokenizer = store.renderer.tokenizer
        self.stop_ids = tuple(dict.fromkeys(tuple(self.renderer.end_of_turn_ids) +
                                            tuple(int(i) for i in stop_ids)))
        self.parse_tools = get_parser(tool_parser)
        self.reasoning = reasoning
        self.call_timeout_s = float(call_timeout_s)
        self.max_n, self.model_name, self.on_end = int(max_n), model_name, on_end

    # ------------------------------------------------------------------ helpers
    def stop_id_of(self, text: str) -> Optional[int]:
        ids = self.renderer.encode(text)
        return int(ids[0]) if len(ids) == 1 else None

    def _sampling(self, spec, plan: Plan):
        room = self.store.room(plan)
        stops = tuple(dict.fromkeys(self.stop_ids + spec.stop_ids))
        return self.sampling.replace(
            max_tokens=min(room, spec.max_tokens or room),
            seed=spec.seed if spec.seed is not None else secrets.randbits(31),
            stop_token_ids=stops)

    def _generate(self, session, plan: Plan, spec) -> list:
        completions = self.calls.generate(plan.prompt, spec.n, self._sampling(spec, plan),
                                          self.call_timeout_s)
        return sorted(completions, key=lambda c: c.sample_index)

    def end(self, session, *, reward=None, error: str = "", status=None) -> None:
        """End ``session`` and tell ``on_end``."""
        with session.lock:
            self.store.end(session, reward=reward, error=error, status=status)
        if self.on_end is not None:
            self.on_end(session)

    # ------------------------------------------------------------------ calls
    def chat(self, session, body) -> tuple:
        """``/v1/chat/completions`` in ``session``; returns ``(chat.completion dict, the
        checked request)``.

        Raises:
          GatewayError: a refused request (400), the batcher's refusal (400), a timeout
            (504).
        """
        spec = api.parse_call(body, chat=True, sampling=self.sampling,
                              stop_id_of=self.stop_id_of, max_n=self.max_n)
        with session.lock:
            self.store.get(session.id)                   # still open
            plan = self.store.plan(session, spec.messages, spec.tools)
            completions = self._generate(session, plan, spec)
            choices = [self._chat_choice(c, spec, session.id) for c in completions]
            self.store.commit(session, plan, choices)
        rid = api.new_id("chatcmpl")
        return api.chat_response(rid, spec.model or self.model_name, choices,
                                 len(plan.prompt), session.id), spec

    def completion(self, session, body) -> tuple:
        """``/v1/completions`` in ``session`` (token-level prefix reuse: a prompt whose ids
        extend a recorded trajectory's ids extends it)."""
        spec = api.parse_call(body, chat=False, sampling=self.sampling,
                              stop_id_of=self.stop_id_of, max_n=self.max_n)
        ids = spec.prompt if isinstance(spec.prompt, list) else self.renderer.encode(spec.prompt)
        with session.lock:
            self.store.get(session.id)
            plan = self._token_plan(session, [int(i) for i in ids])
            completions = self._generate(session, plan, spec)
            choices = []
            for c in completions:
                text = self.tokenizer.decode(c.tokens.tolist(), skip_special_tokens=True)
                choices.append(self._choice_base(c, spec) | {
                    "text": text, "message": {"role": "assistant", "content": text}})
            self.store.commit(session, plan, choices)
        rid = api.new_id("cmpl")
        return api.completion_response(rid, spec.model or self.model_name, choices,
                                       len(plan.prompt), session.id), spec

    def _token_plan(self, session, ids) -> Plan:
        vocab = len(self.tokenizer)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise GatewayError(400, "invalid_request_error",
                               f"prompt token id(s) {bad[:5]} are outside the vocabulary "
                               f"[0, {vocab})", "prompt")
        best = None
        for t in session.trajectories:
            if t.tools_key == TOKENS_KEY and len(t.ids) < len(ids) and \
                    ids[:len(t.ids)] == t.ids and (best is None or len(t.ids) > len(best.ids)):
                best = t
        if best is not None:
            plan = Plan(best, False, list(ids), len(best.ids), [], [], reused=len(best.ids))
        else:
            root = bool(session.trajectories)
            plan = Plan(Trajectory(TOKENS_KEY, None, prompt_len=len(ids)), True, list(ids), 0,
                        [], [], reused=0, branch=root, from_root=root)
        self.store.check_room(plan)
        return plan

    def _choice_base(self, c, spec) -> dict:
        ids = [int(i) for i in c.tokens]
        lps = [float(x) for x in c.logprobs]
        return {"ids": ids, "logprobs_raw": lps, "versions": [int(v) for v in c.versions],
                "finish_reason": "length" if c.finish_reason == "length" else "stop",
                "logprobs": {"content": api.logprob_entries(self.tokenizer, ids, lps)}
                if spec.logprobs else None}

    def _chat_choice(self, c, spec, session_id: str) -> dict:
        out = self._choice_base(c, spec)
        text = self.renderer.assistant_text(c.tokens)
        answer, message = text, {"role": "assistant"}
        if self.reasoning is not None:
            split = self.reasoning(text)
            answer = split.answer if split.closed else ""
            if split.reasoning:
                message["reasoning_content"] = split.reasoning
        calls = []
        if spec.parse_tools and spec.tools:
            answer, calls, bad = self.parse_tools(answer)
            if bad:
                self.store.count("tool_parse_errors", bad)
        message["content"] = answer if (answer or not calls) else None
        if calls:
            message["tool_calls"] = openai_tool_calls(
                calls, f"call_{session_id[:8]}_{secrets.token_hex(3)}")
            if out["finish_reason"] == "stop":     # a turn cut by max_tokens stays "length"
                out["finish_reason"] = "tool_calls"
        out["message"], out["text"] = message, text
        return out

