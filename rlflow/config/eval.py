"""The held-out evaluation section (``eval``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Tuple

from rlflow.config.validation import _check, _finite_floats, _one_of, _positive, _timeout

SOURCES = ("builtin", "jsonl", "parquet", "arrayrecord")


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: a fixed prompt set sampled at a named policy version and scored
    with reward functions (:mod:`rlflow.eval`). Used by ``rlflow eval`` and, with
    ``every_steps > 0``, during training. The record fields left ``None`` take the ``data``
    section's value, so a GSM8K run evaluates on ``test.jsonl`` with only ``path`` set.

    Attributes:
      every_steps: evaluate the policy of every N-th learner step (version N, 2N, ...; and
        version 0, the initial policy) during training; 0 (default): no evaluation in the run.
      source: "builtin" / "jsonl" / "parquet" / "arrayrecord" (the ``data.source`` formats);
        None: ``data.source``.
      path: file (or glob) of the held-out records, e.g. GSM8K's ``test.jsonl``; required
        for a non-builtin source. Never the training file: ``rlflow train`` refuses an
        ``eval.path`` equal to ``data.path``.
      task: built-in task when the source is "builtin"; None: ``data.task``.
      prompt_field / answer_field / chat_template / plain_template / max_prompt_tokens:
        as in ``data``; None: the ``data`` section's value.
      num_prompts: prompts per evaluation: the first N kept records of the file, in file
        order (the same prompts at every version); 0: all of them.
      num_samples: completions per prompt (k >= 1): pass@k and maj@k are computed over them.
      temperature / top_k / top_p: the evaluation's own sampling settings (temperature 0 is
        greedy; then every sample of a prompt is the same and k > 1 adds nothing).
      max_tokens: most new tokens per completion; None: ``sampler.max_tokens`` (at most it:
        the sampler's KV cache holds that many).
      seed: base seed of the evaluation's sampling (prompt ``i`` draws with
        ``derive_seed(seed, i)``, the same at every version).
      functions / weights: reward functions that score the completions (names as in
        ``reward.functions``); empty: the ``reward`` section's functions and weights. A
        sample counts as correct (pass@k, maj@k) when its reward is at least half the best
        total (the sum of the positive weights). Each function's mean is reported as
        ``eval/reward/<name>``; one with weight 0 is reported only (e.g. ``("math_verify",
        "last_number")`` with ``(1.0, 0.0)``: the strict accuracy beside pass@1).
      timeout_s: seconds the learner waits for one evaluation's results before it logs it
        as incomplete (``eval/complete`` 0); the run never waits for an evaluation.
      num_logged_samples: completions of each evaluation written to ``eval_samples.jsonl``
        (the first prompts' first samples); 0: none.
    """

    every_steps: int = 0
    source: Optional[Literal["builtin", "jsonl", "parquet", "arrayrecord"]] = None
    path: str = ""
    task: Optional[str] = None
    prompt_field: Optional[str] = None
    answer_field: Optional[str] = None
    chat_template: Optional[Literal["hf", "plain", "none"]] = None
    plain_template: Optional[str] = None
    max_prompt_tokens: Optional[int] = None
    num_prompts: int = 64
    num_samples: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: Optional[int] = None
    seed: int = 0
    functions: Tuple[str, ...] = ()
    weights: Tuple[float, ...] = ()
    timeout_s: float = 600.0
    num_logged_samples: int = 8

    def __post_init__(self):
        _finite_floats(self, "eval")
        _check(self.every_steps >= 0, "eval.every_steps",
               f"must be >= 0 (0: no evaluation during training), got {self.every_steps}")
        if self.source is not None:
            _one_of(self.source, SOURCES, "eval.source")
        if self.chat_template is not None:
            _one_of(self.chat_template, ("hf", "plain", "none"), "eval.chat_template")
        if self.plain_template is not None:
            _check("{prompt}" in self.plain_template, "eval.plain_template",
                   "must contain '{prompt}'")
        if self.max_prompt_tokens is not None:
            _positive(self.max_prompt_tokens, "eval.max_prompt_tokens")
        if self.max_tokens is not None:
            _positive(self.max_tokens, "eval.max_tokens")
        _check(self.num_prompts >= 0, "eval.num_prompts",
               f"must be >= 0 (0: every record), got {self.num_prompts}")
        _positive(self.num_samples, "eval.num_samples")
        _check(self.temperature >= 0, "eval.temperature", f"must be >= 0, got {self.temperature}")
        _check(self.top_k >= 0, "eval.top_k", f"must be >= 0, got {self.top_k}")
        _check(0 < self.top_p <= 1, "eval.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0 <= self.seed < 2**32, "eval.seed", f"must be in [0, 2**32), got {self.seed}")
        _check(len(self.functions) == len(self.weights), "eval.weights",
               f"must have one weight per eval.functions entry ({len(self.functions)}), "
               f"got {len(self.weights)}")
        _timeout(self.timeout_s, "eval.timeout_s")
        _check(self.num_logged_samples >= 0, "eval.num_logged_samples",
               f"must be >= 0, got {self.num_logged_samples}")

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates during training (``every_steps > 0``)."""
        return self.every_steps > 0


def eval_data_config(cfg):
    """The ``DataConfig`` the evaluation prompts are read with: ``eval``'s record fields,
    the ``data`` section's where they are None (no shuffle, one epoch: file order).

    Args:
      cfg: an ``ExperimentConfig``.

    Raises:
      ConfigError: the source is not "builtin" and ``eval.path`` is empty (names the field).
    """
    import dataclasses

    ev, data = cfg.eval, cfg.data
    source = ev.source or data.source
    _check(source == "builtin" or bool(ev.path), "eval.path",
           f"is required for eval.source={source!r} (a held-out file, e.g. GSM8K test.jsonl)")
    pick = lambda name: getattr(data, name) if getattr(ev, name) is None \
        else getattr(ev, name)  # noqa: E731 - one rule for every field
    return dataclasses.replace(
        data, source=source, path=ev.path if source != "builtin" else "",
        **{name: pick(name) for name in ("task", "prompt_field", "answer_field",
                                         "chat_template", "plain_template",
                                         "max_prompt_tokens")},
        num_epochs=1)


def eval_reward_config(cfg):
    """The ``RewardConfig`` that scores the evaluation: ``eval.functions`` / ``weights``, or
    the ``reward`` section's when ``eval.functions`` is empty (its timeouts and workers)."""
    import dataclasses

    if not cfg.eval.functions:
        return cfg.reward
    return dataclasses.replace(cfg.reward, functions=tuple(cfg.eval.functions),
                               weights=tuple(float(w) for w in cfg.eval.weights))


def eval_max_tokens(cfg) -> int:
    """``eval.max_tokens``, or ``sampler.max_tokens`` when None."""
    return cfg.eval.max_tokens or cfg.sampler.max_tokens
