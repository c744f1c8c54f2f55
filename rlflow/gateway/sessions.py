"""Agent sessions as episodes: exact token ids, behaviour logprobs, policy versions and loss
mask of every call, reused when the agent sends its history back.

A *session* is the sequence of one agent's calls (its id is in the URL or a header). It holds
one or more *trajectories*; each is a token sequence built like a multi-turn episode
(:mod:`rlflow.envs.chat`)::

    ids = ids(A_1) + sampled_1 + continuation_1 + sampled_2 + ...     (mask 0, 1, 0, 1, ...)

where ``A_1`` is the first call's messages rendered by the chat template with the generation
prompt, ``sampled_t`` the ids the sampler generated for call ``t`` (end-of-turn id included;
behaviour logprob and policy version per token) and ``continuation_t`` the chat template's
rendering of the messages the agent added after the sampled turn (tool results, user turns),
ending with the next generation prompt (logprob 0, version -1).

Reuse (token in, token out): a call's history is matched *as messages* against a
trajectory's record: each assistant turn the gateway sampled is stored as the OpenAI message it
returned (content, tool calls; tool-call ids and reasoning are not compared) and as the exact
sampled text for the template. When a trajectory's messages through one of its sampled turns
are a prefix of the history, the call's prompt is the recorded ids through that turn plus the
continuation of the new messages; past turns are never re-tokenized. Cases:

* the prefix ends at the trajectory's last sampled turn: the trajectory is extended (no
  copy, no branch);
* it ends at an earlier turn (the agent retried or edited a later message): a *branch* -- a
  new trajectory sharing the recorded ids up to that turn, counted (``branches``);
* no trajectory matches (the agent rewrote an early message, changed ``tools``, or the first
  sampled turn never ended on the end-of-turn id): a *branch* from the history rendered anew,
  counted (``branches`` and ``branches_from_root``).

``n > 1`` choices fork the trajectory: choice 0 extends it, each other choice is a new
trajectory (``forks``); the agent's next history picks which one goes on.

The episode a session gives the learner is its *head*: the trajectory its last call extended
(:meth:`Session.episode`). The other trajectories' sampled tokens are counted
(``tokens_off_head``), not trained on (a GRPO group has one sample per session).

Thread safety: each session has a lock; the HTTP handler holds it for one call (plan,
generate, commit), so the calls of one session run one at a time. The store's own lock guards
the session table and the counters.
"""

from __future__ import annotations

import collections
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from rlflow.gateway.tool_calls import content_text, template_message


class GatewayError(Exception):
    """A refused call: HTTP ``status``, OpenAI error ``code`` and a message that names the
    field and what was expected."""

    def __init__(self, status: int, code: str, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = int(status), code, message, param


def normalized(message: dict) -> tuple:
    """A message as compared for reuse: role, text, tool calls (name and arguments as
    canonical JSON; ids dropped), ``tool_call_id`` and ``name``.

    Raises:
      GatewayError: 400 for a message that is not a dict with a string ``role`` or whose
        content is not text.
    """
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise GatewayError(400, "invalid_request_error",
                           f"each message must be an object with a string 'role', got "
                           f"{str(message)[:80]!r}", "messages")
    try:
        text = content_text(message.get("content"), "content")
    except ValueError as e:
        raise GatewayError(400, "invalid_request_error", f"messages: {e}", "messages") from None
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        calls.append((str(fn.get("name")), json.dumps(args, sort_keys=True)))
    return (message["role"], text, tuple(calls), str(message.get("tool_call_id") or ""),
            str(message.get("name") or ""))


@dataclass(eq=False)          # compared by identity (two regenerations may be equal)
class Trajectory:
    """One token sequence of a session (see the module docstring).

    Attributes:
      tools_key: the call's ``tools`` as canonical JSON (a change of tools never reuses).
      tools: the tools as given (passed to the chat template).
      prompt_len: length of ``ids(A_1)``.
      ids, mask, logprobs, versions: per token (int, 0/1, float32 behaviour logprob, int policy
        version; -1 and 0.0 on tokens the policy did not sample).
      render: the conversation for the chat template (sampled assistant turns as their exact
        text).
      api: the conversation as the agent sees it, :func:`normalized`.
      turn_ends: ``(len(api), len(ids))`` after each sampled turn that ended on the template's
        end-of-turn id (the points a continuation can start from).
      calls: calls that extended it.
    """

    tools_key: str
    tools: Any
    prompt_len: int
    ids: List[int] = field(default_factory=list)
    mask: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)
    render: List[dict] = field(default_factory=list)
    api: List[tuple] = field(default_factory=list)
    turn_ends: List[tuple] = field(default_factory=list)
    calls: int = 0

    def cut(self, n_api: int, n_ids: int) -> "Trajectory":
        """A copy through the sampled turn that ends at ``(n_api, n_ids)``."""
        ends = [t for t in self.turn_ends if t[1] <= n_ids]
        return Trajectory(self.tools_key, self.tools, self.prompt_len, self.ids[:n_ids],
                          self.mask[:n_ids], self.logprobs[:n_ids], self.versions[:n_ids],
                          self.render[:n_api], self.api[:n_api], ends)

    def sampled(self) -> int:
        return int(sum(self.mask))


@dataclass
class Plan:
    """What one call will extend: ``trajectory`` (an existing one, or a new one when
    ``new``), the full ``prompt`` ids to generate from, and the messages to append before
    the sampled turn (``render_new``, ``api_new``)."""

    trajectory: Trajectory
    new: bool
    prompt: List[int]
    base_len: int
    render_new: List[dict]
    api_new: List[tuple]
    reused: int
    branch: bool = False
    from_root: bool = False


@dataclass
class Session:
    """One agent session. ``status``: "open", "ended" (reward posted or the agent returned),
    "failed" (the agent crashed or reported an error), "expired" (idle past the timeout)."""

    id: str
    owner: str = ""
    task: Any = None
    group: Any = None
    reward: Optional[float] = None
    status: str = "open"
    error: str = ""
    trajectories: List[Trajectory] = field(default_factory=list)
    head: int = -1
    last_active: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def episode(self) -> Optional[dict]:
        """The head trajectory as arrays: ``prompt`` int32 ``[P]`` (its first prompt, at most
        as long as the session's first call's), ``tokens`` int32 ``[T]`` (everything after it), ``mask`` bool ``[T]``, ``logprobs`` float32
        ``[T]``, ``versions`` int32 ``[T]``; None when the session made no call."""
        if self.head < 0:
            return None
        t = self.trajectories[self.head]
        # a branch from the root renders earlier turns into its first prompt: the episode's
        # prompt is never longer than the session's first one (the rest gets no loss)
        p = min(t.prompt_len, self.trajectories[0].prompt_len)
        return {"prompt": np.asarray(t.ids[:p], np.int32),
                "tokens": np.asarray(t.ids[p:], np.int32),
                "mask": np.asarray(t.mask[p:], bool),
                "logprobs": np.asarray(t.logprobs[p:], np.float32),
                "versions": np.asarray(t.versions[p:], np.int32)}


log = logging.getLogger("rlflow.gateway")

#: Branches logged (where the history differs from the record), then counted only.
LOG_FIRST_BRANCHES = 20

#: Closed external sessions (no group: not trained on) kept readable, oldest dropped first.
KEEP_CLOSED_EXTERNAL = 1024

COUNTERS = ("sessions_opened", "sessions_ended", "sessions_failed", "sessions_expired",
            "calls", "branches", "branches_from_root", "forks", "reused_tokens",
            "sampled_tokens", "continuation_tokens", "prompt_tokens_rendered",
            "tokens_off_head", "tool_parse_errors", "refused_calls")


class SessionStore:
    """The gateway's sessions.

    Args:
      renderer: :class:`rlflow.envs.chat.ChatRenderer` of the run's tokenizer.
      max_prompt_tokens: most ids one call's prompt (the whole conversation so far) may
        have: ``sampler.max_prefill_length`` (each call is prefilled whole).
      max_episode_tokens: most ids after the first prompt (sampled and continuation ids
        together): the record's ``T``.
      max_call_tokens: most ids one call may sample (``sampler.max_tokens``).
    """

    def __init__(self, renderer, *, max_prompt_tokens: int, max_episode_tokens: int,
                 max_call_tokens: int):
        self.renderer = renderer
        self.max_prompt_tokens = int(max_prompt_tokens)
        self.max_episode_tokens = int(max_episode_tokens)
        self.max_call_tokens = int(max_call_tokens)
        self._sessions: Dict[str, Session] = {}
        self._closed_external: "collections.deque[str]" = collections.deque()
        self._lock = threading.Lock()
        self.counts = {k: 0 for k in COUNTERS}

    # ------------------------------------------------------------------ table
    def open(self, session_id: Optional[str] = None, *, owner: str = "", task=None,
             group=None) -> Session:
        """A new session (id: ``session_id`` or a random one).

        Raises:
          GatewayError: 409 when ``session_id`` is taken.
        """
        sid = session_id or secrets.token_hex(8)
        with self._lock:
            if sid in self._sessions:
                raise GatewayError(409, "session_exists", f"session {sid!r} already exists")
            s = self._sessions[sid] = Session(sid, owner=owner, task=task, group=group)
            self.counts["sessions_opened"] += 1
        return s

    def get(self, session_id: str, owner: Optional[str] = None) -> Session:
        """The open session ``session_id``.

        Raises:
          GatewayError: 404 unknown session, 403 a session of another owner, 409 a session
            that is no longer open (names its status).
        """
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None:
            raise GatewayError(404, "unknown_session",
                               f"unknown session {session_id!r}: open it first (POST "
                               f"/rlflow/v1/sessions) or use the id the run gave the agent")
        if owner is not None and s.owner and owner != s.owner:
            raise GatewayError(403, "wrong_session_owner",
                               f"session {session_id!r} belongs to another agent")
        if s.status != "open":
            raise GatewayError(409, "session_closed",
                               f"session {session_id!r} is {s.status}; it takes no more calls")
        return s

    def peek(self, session_id: str) -> Optional[Session]:
        """The session ``session_id`` whatever its status, or None."""
        with self._lock:
            return self._sessions.get(session_id)

    def pop(self, session_id: str) -> Optional[Session]:
        with self._lock:
            return self._sessions.pop(session_id, None)

    def end(self, session: Session, *, reward: Optional[float] = None, error: str = "",
            status: Optional[str] = None) -> None:
        """Close ``session``: "ended" with ``reward``, or "failed" with ``error``."""
        with self._lock:
            if session.status != "open":
                return
            session.status = status or ("failed" if error else "ended")
            session.reward, session.error = reward, error
            self.counts[f"sessions_{session.status}"] += 1
            if session.group is None:       # an external session: kept for reading, bounded
                self._closed_external.append(session.id)
                while len(self._closed_external) > KEEP_CLOSED_EXTERNAL:
                    self._sessions.pop(self._closed_external.popleft(), None)
            if session.head >= 0:
                head = session.trajectories[session.head]
                self.counts["tokens_off_head"] += sum(
                    t.sampled() for t in session.trajectories) - head.sampled()

    def idle(self, older_than_s: float) -> List[Session]:
        """Open sessions with no call for ``older_than_s`` seconds (not holding a call)."""
        now = time.monotonic()
        with self._lock:
            found = [s for s in self._sessions.values() if s.status == "open" and
                     now - s.last_active > older_than_s]
        return [s for s in found if not s.lock.locked()]

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    # ------------------------------------------------------------------ calls
    def plan(self, session: Session, messages: Sequence[dict], tools=None) -> Plan:
        """Which trajectory the call extends and its prompt ids (nothing is changed yet).

        Raises:
          GatewayError: 400 for messages that are not chat messages or that the chat template
            cannot render, or a conversation that does not end with a message for the model
            to answer; 400 ``context_length_exceeded`` when the prompt is longer than
            ``max_prompt_tokens`` or leaves no room in the episode (names both numbers).
        """
        if not isinstance(messages, list) or not messages:
            raise GatewayError(400, "invalid_request_error",
                               "'messages' must be a non-empty list", "messages")
        api = [normalized(m) for m in messages]
        if api[-1][0] == "assistant":
            raise GatewayError(400, "invalid_request_error",
                               "the last message is an assistant message: continuing a "
                               "partial assistant turn is not served", "messages")
        tools_key = json.dumps(tools, sort_keys=True)
        plan = self._reuse(session, api, tools_key)
        if plan is None:
            plan = self._fresh(session, messages, api, tools, tools_key)
        if plan.branch and self.counts["branches"] < LOG_FIRST_BRANCHES:
            _log_branch(session, api, tools_key, plan)
        self.check_room(plan)
        return plan

    def _reuse(self, session: Session, api, tools_key) -> Optional[Plan]:
        best = None
        for i, t in enumerate(session.trajectories):
            if t.tools_key != tools_key:
                continue
            for n_api, n_ids in reversed(t.turn_ends):
                if n_api < len(api) and t.api[:n_api] == api[:n_api]:
                    extend = n_ids == len(t.ids)
                    key = (extend, n_ids, i == session.head)
                    if best is None or key > best[0]:
                        best = (key, t, n_api, n_ids)
                    break
        if best is None:
            return None
        (extend, _, _), t, n_api, n_ids = best
        messages = [_render_of(a) for a in api[n_api:]]
        try:
            cont = self.renderer.continuation_ids(t.render[:n_api], messages, tools=t.tools)
        except Exception as e:  # noqa: BLE001 - a history the template cannot render
            raise GatewayError(400, "invalid_request_error",
                               f"the chat template cannot render the new messages: "
                               f"{type(e).__name__}: {e}", "messages") from None
        base = t if extend else t.cut(n_api, n_ids)
        return Plan(base, not extend, base.ids[:n_ids] + cont, n_ids, messages, api[n_api:],
                    reused=n_ids, branch=not extend)

    def _fresh(self, session, messages, api, tools, tools_key) -> Plan:
        try:
            render = [template_message(m) for m in messages]
            prompt = self.renderer.prompt_ids(render, tools=tools)
        except Exception as e:  # noqa: BLE001 - named in the refusal
            raise GatewayError(400, "invalid_request_error",
                               f"the chat template cannot render the messages: "
                               f"{type(e).__name__}: {e}", "messages") from None
        t = Trajectory(tools_key, tools, prompt_len=len(prompt))
        branch = bool(session.trajectories)
        return Plan(t, True, list(prompt), 0, render, api, reused=0, branch=branch,
                    from_root=branch)

    def check_room(self, plan: Plan) -> None:
        """Refuse a plan whose prompt or episode would pass the limits (400
        ``context_length_exceeded``, naming both numbers)."""
        p = len(plan.prompt)
        if p > self.max_prompt_tokens:
            raise GatewayError(400, "context_length_exceeded",
                               f"the conversation is {p} tokens; this model's context takes "
                               f"prompts of at most {self.max_prompt_tokens} tokens "
                               f"(sampler.max_prefill_length)", "messages")
        prompt_len = plan.trajectory.prompt_len if plan.base_len else p
        if p - prompt_len + 1 > self.max_episode_tokens:
            raise GatewayError(400, "context_length_exceeded",
                               f"the session holds {p - prompt_len} tokens after its first "
                               f"prompt; an episode holds at most {self.max_episode_tokens} "
                               f"(gateway.max_episode_tokens), no room for another turn",
                               "messages")

    def room(self, plan: Plan) -> int:
        """Most ids the call may sample: the episode's room and ``max_call_tokens``."""
        prompt_len = plan.trajectory.prompt_len if plan.base_len else len(plan.prompt)
        left = self.max_episode_tokens - (len(plan.prompt) - prompt_len)
        return max(1, min(self.max_call_tokens, left))

    def commit(self, session: Session, plan: Plan, choices: Sequence[dict]) -> None:
        """Record a call's choices: ``[{"ids", "logprobs_raw", "versions", "message", "text"}]``
        (``message``: the OpenAI message returned; ``text``: the exact sampled text)."""
        base = plan.trajectory
        n_cont = len(plan.prompt) - plan.base_len
        sampled = 0
        # len(base.ids) == plan.base_len here: forks are copies taken before choice 0
        forks = [base.cut(len(base.api), plan.base_len) for _ in choices[1:]]
        for k, choice in enumerate(choices):
            t = base if k == 0 else forks[k - 1]
            cont = plan.prompt[plan.base_len:]
            t.ids += cont
            t.mask += [0] * len(cont)
            t.logprobs += [0.0] * len(cont)
            t.versions += [-1] * len(cont)
            t.render += list(plan.render_new) + [{"role": "assistant", "content": choice["text"]}]
            t.api += list(plan.api_new) + [normalized(choice["message"])]
            ids = [int(i) for i in choice["ids"]]
            t.ids += ids
            t.mask += [1] * len(ids)
            t.logprobs += [float(x) for x in choice["logprobs_raw"]]
            t.versions += [int(v) for v in choice["versions"]]
            if ids and ids[-1] == self.renderer.turn_end_id:
                t.turn_ends.append((len(t.api), len(t.ids)))
            t.calls += 1
            sampled += len(ids)
            if k == 0:
                if plan.new:
                    session.trajectories.append(t)
                session.head = next(i for i, x in enumerate(session.trajectories) if x is t)
            else:
                session.trajectories.append(t)
        session.last_active = time.monotonic()
        with self._lock:
            c = self.counts
            c["calls"] += 1
            c["branches"] += int(plan.branch)
            c["branches_from_root"] += int(plan.from_root)
            c["forks"] += len(choices) - 1
            c["reused_tokens"] += plan.reused
            c["sampled_tokens"] += sampled
            if plan.base_len:
                c["continuation_tokens"] += n_cont
            else:
                c["prompt_tokens_rendered"] += n_cont

    def metrics(self) -> Dict[str, float]:
        """``gateway/<counter>`` and ``gateway/sessions_open``."""
        with self._lock:
            out = {f"gateway/{k}": float(v) for k, v in self.counts.items()}
            out["gateway/sessions_open"] = float(sum(s.status == "open"
                                                     for s in self._sessions.values()))
        return out


def _log_branch(session: Session, api, tools_key: str, plan: Plan) -> None:
    """Log where a branching history first differs from the head trajectory's record."""
    head = session.trajectories[session.head] if session.head >= 0 else None
    if head is None:
        return
    at = next((i for i, (a, b) in enumerate(zip(head.api, api)) if a != b),
              min(len(head.api), len(api)))
    log.info("gateway session %s: the history is a branch (%s): message %d differs from the "
             "record (%s vs %s); tools %s", session.id,
             "from the root" if plan.from_root else f"sharing {plan.reused} ids",
             at, str(head.api[at] if at < len(head.api) else None)[:200],
             str(api[at] if at < len(api) else None)[:200],
             "same" if tools_key == head.tools_key else "changed")


def _render_of(api_message: tuple) -> dict:
    """A new (agent-written) message for the chat template, from its normalized form."""
    role, text, calls, call_id, name = api_message
    m: Dict[str, Any] = {"role": role, "content": text}
    if calls:
        m["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                            "function": {"name": n, "arguments": json.loads(a)}}
                           for i, (n, a) in enumerate(calls)]
    if call_id:
        m["tool_call_id"] = call_id
    if name:
        m["name"] = name
    return m
