"""The sampler's episode driver: environments, chat rendering and worker calls of the
multi-turn episodes the batcher runs (:mod:`rlflow.sampler.episode_slots`).

Per group (one leased prompt), :meth:`EpisodeDriver.new_group` creates ``G`` environments
from the prompt's record (the factory of ``env.name`` with ``env.options``), resets them
(in this process: a reset must be quick and side-effect free; the ``G`` resets must give
the same messages, since the group shares one prompt), and renders the first messages with
the model's chat template as the group's prompt ids. Then, per episode:

* ``turn_ended``: the turn's sampled ids (end-of-turn ids stripped) are decoded to the
  assistant message (``renderer.assistant_text``) and ``env.step`` is queued to an
  environment worker (:mod:`rlflow.sampler.env_workers`); decoding of the other slots goes
  on.
* ``poll``: answers that arrived become :class:`EpisodeOutcome`: ``done`` -> the
  environment's reward; not done and the turn limit (``env.max_turns``) reached -> cut,
  truncated, reward 0 (or the environment's reward if it gave one); otherwise the new
  messages rendered as continuation ids (``renderer.continuation_ids``: the suffix after
  the sampled ids, the next assistant header included; past turns are never
  re-tokenized). An environment that raises, times out (``env.step_timeout_s``), dies or
  returns something other than an :class:`rlflow.envs.EnvStep` (a reward that is not a
  finite number, an ``info`` value that is not a number, messages that are not message
  dicts) ends its episode with reward 0, counted (``sampler/env_errors``,
  ``sampler/env_timeouts``), logged and marked failed in the group record (``failed``: the
  learner leaves it out of the loss and the baseline, ``learner.on_failed_sample``); the run
  goes on, unless ``env.max_consecutive_errors`` steps in a row failed (timeouts included): then
  :meth:`EpisodeDriver.poll` raises :class:`rlflow.envs.EnvFailureError`. New messages whose
  text alone is longer than the episode's token limit could hold
  (:func:`rlflow.data.tokenizer.char_bound`) are not rendered: the episode ends as truncated
  with reward 0 (counted with ``sampler/episodes_cut_tokens``), as a continuation past the
  limit does; a tokenizer would take minutes and gigabytes over a message of megabytes.

Resume (the journal of partial generations, :mod:`rlflow.run.journal`): an episode's
environment state is not serialised (an environment is any Python object); a replica that
resumes a journaled episode rebuilds it deterministically by replaying the recorded turns
(:meth:`EpisodeDriver.resume`): fresh environments from the record (``new_group``), then each
sampled turn that the environment answered is decoded and stepped again (in a worker when
there is a pool), and the answer rendered must equal, id for id, the environment tokens the
journal recorded after that turn. So an environment must answer the same turns alike (as it
must reset alike per record); one that does not (or that fails during the replay) is counted
(``sampler/episodes_replay_mismatch``) and its episode starts over from the prompt, never
continued on a state other than the one its tokens were sampled in.

The renderer is :class:`rlflow.envs.chat.ChatRenderer` (``prompt_ids(messages, tools)``,
``continuation_ids(messages, new_messages, tools)``, ``assistant_text(ids)``,
``end_of_turn_ids``); an environment
may expose ``tools`` (a list of JSON tool schemas) for the template.
"""

from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from rlflow.envs.base import EnvFailureError, EnvStep, bind_options, get_environment
from rlflow.sampler.episode_slots import EpisodeOutcome

log = logging.getLogger("rlflow.sampler.episodes")
LOG_FIRST = 10


@dataclass
class EpisodeGroup:
    """One prompt's ``G`` episodes: environments, conversations and turns so far."""

    record: dict
    envs: list
    messages: List[list]
    tools: Any = None
    turns: List[int] = field(default_factory=list)


class EpisodeDriver:
    """Environments of the episodes in flight (see the module docstring).

    Args:
      env_cfg: :class:`rlflow.config.EnvConfig`.
      tokenizer: the model's tokenizer.
      renderer: a chat renderer (``rlflow.envs.chat.ChatRenderer(tokenizer)``).
      pool: a worker pool (``rlflow.sampler.env_workers.env_pool``); ``None``: steps run
        in this process (tests and debugging only: a hanging step is not stopped).
      max_prompt_tokens: the prompt's token limit (``sampler.max_prefill_length``): first
        messages whose text is longer than it could hold are refused before rendering.
      max_episode_tokens: the episode's token limit after the prompt
        (``env.episode_tokens(sampler.max_tokens)``): new messages whose text is longer than
        it could hold end the episode, truncated, before rendering. ``None`` (either): no
        bound (the tokenizer needs a ``get_vocab()`` otherwise).
      reasoning: a thinking model's completion splitter (``data.reasoning_parser``,
        :mod:`rlflow.data.reasoning`): ``env.step`` gets the turn's answer part only (a tool
        call drafted while thinking is not run), and a turn whose reasoning never closed
        ends the episode with reward 0 without a step (counted:
        ``sampler/episodes_reasoning_unclosed``). None: the whole message.

    Raises:
      rlflow.envs.EnvError: ``env.name`` is not registered or cannot be imported, or an
        ``env.options`` entry is not one of its options or does not convert.
    """

    def __init__(self, env_cfg, tokenizer, renderer, pool=None, *,
                 max_prompt_tokens: Optional[int] = None,
                 max_episode_tokens: Optional[int] = None, reasoning=None):
        from rlflow.data.tokenizer import char_bound

        self.cfg = env_cfg
        self.max_prompt_chars = None if max_prompt_tokens is None else \
            char_bound(tokenizer, max_prompt_tokens)
        self.max_step_chars = None if max_episode_tokens is None else \
            char_bound(tokenizer, max_episode_tokens)
        self.factory = get_environment(env_cfg.name)
        self.options = bind_options(self.factory, env_cfg.option_dict())
        self.tokenizer, self.renderer, self.pool = tokenizer, renderer, pool
        self.reasoning = reasoning
        self.stop_ids = tuple(int(i) for i in renderer.end_of_turn_ids)
        self._tasks: Dict[int, tuple] = {}
        self._answers: list = []          # (group, index, status, value) answered in-process
        # episodes_cut_tokens: here, those whose new messages were too long to render
        # (the batcher counts the continuations past the limit; the program adds both)
        self.counts = {"env_steps": 0, "env_errors": 0, "env_timeouts": 0,
                       "episodes": 0, "episodes_cut_turns": 0, "episodes_cut_tokens": 0,
                       "episodes_reasoning_unclosed": 0, "episodes_resumed": 0,
                       "episodes_replayed_steps": 0, "episodes_replay_mismatch": 0}
        self.info: Dict[str, float] = {}
        self._error_run = 0             # failed steps since the last successful one

    # ------------------------------------------------------------------ groups
    def new_group(self, record: dict, group_size: int) -> tuple:
        """``G`` environments for ``record``: returns ``(prompt ids int32 [P], group)``.

        Raises:
          rlflow.envs.EnvError: the resets differ or return something other than a
            non-empty list of messages (names the environment and the prompt).
        """
        from rlflow.envs.base import EnvError

        envs = [self.factory(record, **self.options) for _ in range(group_size)]
        first = [env.reset() for env in envs]
        where = f"environment {self.cfg.name!r}, prompt_id {record.get('prompt_id', '?')}"
        if not isinstance(first[0], list) or not first[0] or \
                not all(isinstance(m, dict) and "role" in m for m in first[0]):
            raise EnvError(f"{where}: reset() must return a non-empty list of message dicts "
                           f"with 'role' and 'content', got {first[0]!r:.200}")
        chars = _text_chars(first[0])
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise EnvError(f"{where}: reset() returned {chars} characters of messages, more "
                           f"than sampler.max_prefill_length tokens can hold (at most "
                           f"{self.max_prompt_chars} characters with this tokenizer)")
        if any(m != first[0] for m in first[1:]):
            raise EnvError(f"{where}: the {group_size} resets of one prompt gave different "
                           f"messages (a group shares one prompt: make reset deterministic "
                           f"per record)")
        tools = getattr(envs[0], "tools", None)
        prompt = np.asarray(self.renderer.prompt_ids(first[0], tools=tools), np.int32)
        group = EpisodeGroup(record=record, envs=envs, messages=[list(m) for m in first],
                             tools=tools, turns=[0] * group_size)
        self.counts["episodes"] += group_size
        return prompt, group

    # ------------------------------------------------------------------ batcher hooks
    def turn_ended(self, group: EpisodeGroup, index: int, ids: np.ndarray, used: int) -> None:
        """An episode's turn ended on a stop id: queue its environment step."""
        text = self.renderer.assistant_text(ids)
        group.messages[index].append({"role": "assistant", "content": text})
        group.turns[index] += 1
        env = group.envs[index]
        if self.reasoning is not None:          # the environment reads the answer only
            split = self.reasoning(text)
            if not split.closed:                # no answer stated: reward 0, no step
                self.counts["episodes_reasoning_unclosed"] += 1
                self._answers.append((group, index, "ok", (EnvStep(done=True, reward=0.0), env)))
                return
            text = split.answer
        self.counts["env_steps"] += 1
        if self.pool is None:
            try:
                self._answers.append((group, index, "ok", (env.step(text), env)))
            except Exception as e:  # noqa: BLE001 - counted; the episode ends, reward 0
                self._answers.append((group, index, "error", f"{type(e).__name__}: {e}"))
            return
        self._tasks[self.pool.submit_call(env, text)] = (group, index)

    def poll(self, timeout: float = 0.0) -> list:
        """Answers that arrived (waiting at most ``timeout`` s for the first):
        ``[(group, index, EpisodeOutcome)]``.

        Raises:
          rlflow.envs.EnvFailureError: ``env.max_consecutive_errors`` steps in a row failed.
        """
        answers, self._answers = self._answers, []
        if self.pool is not None and self._tasks:
            for task_id, status, value in self.pool.poll(0.0 if answers else timeout):
                group, index = self._tasks.pop(task_id)
                answers.append((group, index, status, value))
        return [(g, i, self._outcome(g, i, status, value)) for g, i, status, value in answers]

    def resume(self, group: EpisodeGroup, index: int, tokens, versions, stop_ids
               ) -> tuple[int, bool, int]:
        """Rebuild episode ``index`` of ``group`` (a fresh group from :meth:`new_group`) at
        the point its journaled ``tokens`` reached, by replaying its turns (module doc).

        Args:
          tokens: int ``[n]`` the episode's ids after the prompt so far: sampled turns
            (``versions >= 0``) and the environment's answers between them (version -1).
          versions: int ``[n]`` their policy versions.
          stop_ids: the request's stop ids (a sampled run ending on one ended its turn).

        Returns:
          ``(turn_start, parked, turns)``: the first position of the turn in progress (``n``
          when the last ids are the environment's: the next turn has not begun), whether
          the last turn ended and waits for its environment step (the caller hands it to
          :meth:`turn_ended`: that step runs again), and the turns replayed.

        Raises:
          EpisodeReplayError: the ids do not start with a sampled turn, a replayed step
            fails, ends the episode, or answers other ids than those recorded (counted,
            ``sampler/episodes_replay_mismatch``; the environment and conversation are
            fresh again: the caller starts the episode over).
        """
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        runs = _runs(np.asarray(versions).reshape(-1) >= 0)
        first = [dict(m) for m in group.messages[index]]
        try:
            if not runs or not runs[0][2] or len(tokens) != len(versions):
                raise EpisodeReplayError("its ids do not begin with a sampled turn")
            turns = [(runs[i], runs[i + 1]) for i in range(0, len(runs) - 1, 2)]
            for (a, b, _), (c, d, _) in turns:
                self._replay_turn(group, index, tokens[a:b], tokens[c:d])
        except EpisodeReplayError as e:
            self.counts["episodes_replay_mismatch"] += 1
            group.envs[index] = self.factory(group.record, **self.options)
            group.envs[index].reset()
            group.messages[index], group.turns[index] = first, 0
            log.warning("environment %r, prompt_id %s episode %d: its journaled turns cannot "
                        "be replayed (%s); the episode starts over", self.cfg.name,
                        group.record.get("prompt_id", "?"), index, e)
            raise
        self.counts["episodes_resumed"] += 1
        a, b, sampled = runs[-1]
        if not sampled:                               # the environment's answer was last
            return len(tokens), False, len(turns)
        return a, int(tokens[-1]) in set(int(i) for i in stop_ids), len(turns)

    def _replay_turn(self, group: EpisodeGroup, index: int, turn, answer) -> None:
        """Step episode ``index`` again with its sampled ``turn`` ids; the rendered answer
        must be ``answer``, the ids the journal recorded (:meth:`resume`)."""
        text = self.renderer.assistant_text(turn)
        messages = group.messages[index]
        messages.append({"role": "assistant", "content": text})
        group.turns[index] += 1
        if self.reasoning is not None:
            split = self.reasoning(text)
            if not split.closed:
                raise EpisodeReplayError(f"turn {group.turns[index]}: its reasoning never "
                                         f"closed, yet the environment answered it")
            text = split.answer
        step, env = self._step_now(group.envs[index], text)
        self.counts["episodes_replayed_steps"] += 1
        bad = _bad_step(step)
        if bad or step.done or group.turns[index] >= self.cfg.max_turns:
            raise EpisodeReplayError(f"turn {group.turns[index]}: the replayed step "
                                     f"{bad or 'ended the episode'}")
        group.envs[index] = env
        cont = self.renderer.continuation_ids(messages, step.messages, tools=group.tools)
        if [int(i) for i in cont] != [int(i) for i in answer]:
            raise EpisodeReplayError(
                f"turn {group.turns[index]}: the replayed step's answer renders as "
                f"{len(cont)} ids {list(cont)[:8]}..., the journal holds {len(answer)} ids "
                f"{[int(i) for i in answer][:8]}...")
        messages.extend(step.messages)

    def _step_now(self, env, text: str) -> tuple:
        """``(EnvStep, environment)`` of ``env.step(text)``, waited for (in a worker when
        there is a pool; answers of other episodes that arrive meanwhile are kept for
        :meth:`poll`).

        Raises:
          EpisodeReplayError: the step raised or timed out.
        """
        if self.pool is None:
            try:
                return env.step(text), env
            except Exception as e:  # noqa: BLE001 - the replay fails; the episode restarts
                raise EpisodeReplayError(f"the replayed step raised {type(e).__name__}: "
                                         f"{e}") from None
        task = self.pool.submit_call(env, text)
        while True:
            for task_id, status, value in self.pool.poll(1.0):
                if task_id != task:
                    self._answers.append(self._tasks.pop(task_id) + (status, value))
                elif status != "ok":
                    raise EpisodeReplayError(f"the replayed step failed ({status}: {value})")
                else:
                    return value

    def ended(self, group: EpisodeGroup, index: int) -> None:
        """The episode's completion is final: drop its environment."""
        group.envs[index] = None

    # ------------------------------------------------------------------ internals
    def _outcome(self, group: EpisodeGroup, index: int, status: str, value) -> EpisodeOutcome:
        where = f"prompt_id {group.record.get('prompt_id', '?')} episode {index}"
        if status != "ok":
            return self._failed("env_timeouts" if status == "timeout" else "env_errors",
                                where, str(value))
        step, env = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
        bad = _bad_step(step)
        if bad:
            return self._failed("env_errors", where, bad)
        group.envs[index] = env
        for k, v in step.info.items():
            self.info[k] = self.info.get(k, 0.0) + float(v)
        reward = float(step.reward or 0.0)
        if step.done or group.turns[index] >= self.cfg.max_turns:
            self._error_run = 0
        if step.done:
            return EpisodeOutcome(None, reward, False)
        if group.turns[index] >= self.cfg.max_turns:
            self.counts["episodes_cut_turns"] += 1
            return EpisodeOutcome(None, reward, True)
        chars = _text_chars(step.messages)
        if self.max_step_chars is not None and chars > self.max_step_chars:
            self.counts["episodes_cut_tokens"] += 1
            self._error_run = 0          # the environment answered; the episode is too long
            if self.counts["episodes_cut_tokens"] <= LOG_FIRST:
                log.warning("environment %r, %s: step() returned %d characters of messages, "
                            "more than the episode's token limit can hold (at most %d "
                            "characters); the episode ends as truncated, reward 0", self.cfg.name,
                            where, chars, self.max_step_chars)
            return EpisodeOutcome(None, 0.0, True)
        try:
            cont = self.renderer.continuation_ids(group.messages[index], step.messages,
                                                  tools=group.tools)
        except Exception as e:  # noqa: BLE001 - a message the template cannot render
            return self._failed("env_errors", where, f"rendering its messages: "
                                f"{type(e).__name__}: {e}")
        group.messages[index].extend(step.messages)
        self._error_run = 0
        return EpisodeOutcome(np.asarray(cont, np.int32), reward, False)

    def _failed(self, kind: str, where: str, what: str) -> EpisodeOutcome:
        self.counts[kind] += 1
        n = self.counts["env_errors"] + self.counts["env_timeouts"]
        if n <= LOG_FIRST or n % 1000 == 0:
            log.warning("environment %r, %s: %s; the episode ends with reward 0 (%d failures "
                        "so far)", self.cfg.name, where, what, n)
        self._error_run += 1          # errors and timeouts alike: no success in between
        limit = self.cfg.max_consecutive_errors
        if limit and self._error_run >= limit:
            raise EnvFailureError(
                f"environment {self.cfg.name!r} failed (errors or timeouts) on its last "
                f"{self._error_run} steps in a row (env.max_consecutive_errors={limit}), the "
                f"last at {where}: {what}. Fix the environment (or raise the limit or "
                f"env.step_timeout_s; 0: never stop)")
        return EpisodeOutcome(None, 0.0, False, failed=True)

    def metrics(self) -> Dict[str, float]:
        """Counters for the sampler's status: ``sampler/env_*``, ``sampler/episodes*`` and
        the environments' own ``info`` sums as ``env/<key>``."""
        out = {f"sampler/{k}": float(v) for k, v in self.counts.items()}
        out.update({f"env/{k}": v for k, v in self.info.items()})
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


class EpisodeReplayError(ValueError):
    """A journaled episode's turns cannot be replayed through its environment
    (:meth:`EpisodeDriver.resume`)."""


def _runs(sampled: np.ndarray) -> list:
    """``[(start, stop, sampled)]``: the maximal runs of equal values of the bool array
    ``sampled`` (sampled turns and environment answers, alternating)."""
    if not sampled.size:
        return []
    cuts = np.flatnonzero(sampled[1:] != sampled[:-1]) + 1
    starts = np.concatenate([[0], cuts])
    stops = np.concatenate([cuts, [sampled.size]])
    return [(int(a), int(b), bool(sampled[a])) for a, b in zip(starts, stops)]


def _bad_step(step) -> Optional[str]:
    """Why ``step`` is not a valid :class:`EnvStep` (None when it is)."""
    if not isinstance(step, EnvStep):
        return f"step() returned {type(step).__name__}, expected EnvStep"
    if not isinstance(step.messages, list) or not all(
            isinstance(m, dict) and "role" in m for m in step.messages):
        return f"EnvStep.messages must be a list of message dicts, got {step.messages!r:.200}"
    if not step.done and not step.messages:
        return "EnvStep has no messages and done=False (nothing for the policy to answer)"
    if step.reward is not None:
        if not isinstance(step.reward, numbers.Real):
            return (f"EnvStep.reward must be a number (or None), got "
                    f"{type(step.reward).__name__} {step.reward!r:.100}")
        if not np.isfinite(float(step.reward)):
            return f"EnvStep.reward {step.reward} is not finite"
    if not isinstance(step.info, dict):
        return f"EnvStep.info must be a dict of numbers, got {type(step.info).__name__}"
    for key, value in step.info.items():
        if not isinstance(value, numbers.Real) or not np.isfinite(float(value)):
            return (f"EnvStep.info[{key!r}] must be a finite number, got "
                    f"{type(value).__name__} {value!r:.100}")
    return None


def _text_chars(messages) -> int:
    """Characters of the string contents of ``messages`` (other entries are not counted)."""
    return sum(len(m["content"]) for m in messages
               if isinstance(m, dict) and isinstance(m.get("content"), str))


def episode_record(element: dict) -> dict:
    """The record an environment factory gets from a leased prompt: ``prompt_id``,
    ``prompt`` (the prompt text as the data pipeline rendered it; use
    ``data.chat_template="plain"`` with ``plain_template="{prompt}"`` for the raw field) and
    ``answer``."""
    return {"prompt_id": int(element["prompt_id"]), "prompt": str(element.get("prompt_text", "")),
            "answer": str(element.get("answer", ""))}


def sampling_for_episodes(sampling, env_cfg, sampler_max_tokens: int, stop_ids: Sequence[int]):
    """A request's sampling settings for episodes: ``max_tokens`` = the episode token limit,
    stop ids = the end-of-turn ids plus the given ones."""
    import dataclasses

    stops = tuple(dict.fromkeys(tuple(stop_ids) + tuple(sampling.stop_token_ids or ())))
    return dataclasses.replace(sampling, max_tokens=env_cfg.episode_tokens(sampler_max_tokens),
                               stop_token_ids=stops)
