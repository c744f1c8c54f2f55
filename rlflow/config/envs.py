"""Multi-turn environments (``rlflow.envs``): which one, its options and the episode limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from rlflow.config.validation import _check, _positive, _timeout, _finite_floats


@dataclass(frozen=True)
class EnvConfig:
    """The environment each episode runs in (multi-turn / tool-using rollouts).

    With ``name = ""`` (the default) a sample is one completion, as before. With a name, each
    of a prompt's ``G`` samples is an *episode*: the environment (created per episode from the
    prompt's record by the factory registered as ``name``, :mod:`rlflow.envs.base`) gives the
    first messages, the policy answers, the environment answers back (tool results, user
    turns) until it ends the episode or a limit is reached. The episode keeps its sampler slot
    and KV cache across turns; the environment's messages are appended by a prefill of their
    tokens only. The reward is the environment's outcome reward (``reward.functions`` are not
    used). A group's record carries ``loss_mask`` (1 on sampled tokens only).

    Attributes:
      name: registered environment name, or ``"package.module:function"`` /
        ``"path/to/file.py:function"``; ``""``: single-turn sampling (no environment).
      options: ``key=value`` strings passed to the factory as keyword arguments (values are
        strings; the factory converts them), e.g. ``("max_value=9",)``.
      max_turns: most assistant turns per episode (>= 1); an episode still going after its
        last turn is cut and marked truncated.
      max_episode_tokens: most tokens after the prompt (sampled and environment tokens
        together); ``0``: ``sampler.max_tokens`` (the KV cache holds prompt + that many).
        An episode that would pass it is cut and marked truncated.
      step_timeout_s: seconds (wall clock) one ``reset`` or ``step`` call may run in its
        worker process; past it the worker is killed, the episode ends with reward 0 and
        the failure is counted (``sampler/env_timeouts``).
      num_workers: environment worker processes per sampler replica (>= 1); the other slots
        keep decoding while a step runs.
      max_consecutive_errors: the run stops (``rlflow.envs.EnvFailureError``, with the last
        error) when this many prompts in a row could not start their environments (factory
        or ``reset`` failed: each is dropped), or this many ``step`` calls in a row failed
        (raised, returned a bad value, or gave messages the chat template cannot render)
        without a success between: the environment or the data is broken, and the run would
        otherwise train on nothing (or wait forever for groups). A step that runs past
        ``step_timeout_s`` counts as a failure too (an environment that never answers is as
        broken as one that raises). 0: never stop.
    """

    name: str = ""
    options: Tuple[str, ...] = ()
    max_turns: int = 4
    max_episode_tokens: int = 0
    step_timeout_s: float = 30.0
    num_workers: int = 2
    max_consecutive_errors: int = 256

    def __post_init__(self):
        _finite_floats(self, "env")
        _check(isinstance(self.name, str), "env.name", f"must be a string, got {self.name!r}")
        for opt in self.options:
            _check(isinstance(opt, str) and "=" in opt and opt.split("=", 1)[0].strip() != "",
                   "env.options", f"each option must be 'key=value', got {opt!r}")
        keys = [o.split("=", 1)[0].strip() for o in self.options]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        _check(not dup, "env.options", f"repeated key(s) {dup}")
        _positive(self.max_turns, "env.max_turns")
        _check(self.max_episode_tokens >= 0, "env.max_episode_tokens",
               f"must be >= 0 (0: sampler.max_tokens), got {self.max_episode_tokens}")
        _timeout(self.step_timeout_s, "env.step_timeout_s")
        _positive(self.num_workers, "env.num_workers")
        _check(self.max_consecutive_errors >= 0, "env.max_consecutive_errors",
               f"must be >= 0 (0: never stop), got {self.max_consecutive_errors}")

    @property
    def enabled(self) -> bool:
        """Whether samples are multi-turn episodes (``name`` is set)."""
        return bool(self.name)

    def option_dict(self) -> Dict[str, str]:
        """``options`` as keyword arguments: ``{"key": "value"}`` (keys and values stripped)."""
        return {k.strip(): v.strip() for k, v in (o.split("=", 1) for o in self.options)}

    def episode_tokens(self, sampler_max_tokens: int) -> int:
        """The token limit of an episode after the prompt: ``max_episode_tokens`` or, when 0,
        ``sampler.max_tokens``."""
        return self.max_episode_tokens or int(sampler_max_tokens)
