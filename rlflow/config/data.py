"""Prompt data and reward sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Tuple

from rlflow.config.served_reward import HttpRewardConfig, JudgeConfig
from rlflow.config.validation import _check, _positive, _one_of, _timeout, _finite_floats

#: Reward names served over HTTP, each with its own section of ``RewardConfig``.
SERVED_REWARDS = ("http", "judge")


@dataclass(frozen=True)
class DataConfig:
    """Prompt dataset (a grain pipeline).

    Attributes:
      source: "builtin" for a procedural task, or "jsonl" / "parquet" / "arrayrecord".
      path: file (or glob) for non-builtin sources.
      task: name of the built-in task when ``source == "builtin"``.
      prompt_field / answer_field: record fields holding the prompt and the reference answer.
      chat_template: "hf" (the tokenizer's chat template), "plain" (``plain_template``) or "none".
      plain_template: Python format string with ``{prompt}``: the whole prompt text for
        "plain", the user message inside the chat template for "hf"; unused for "none".
      max_prompt_tokens: prompts longer than this (in tokens) are filtered out and counted;
        at most ``sampler.max_prefill_length`` (the longest prompt the sampler takes; the
        default equals the sampler's default) unless ``sampler.on_long_prompt='truncate'``
        (``rlflow train`` refuses it otherwise, :mod:`rlflow.console.checks`).
      shuffle_seed: seed of the deterministic shuffle.
      num_epochs: passes over the dataset (0: unlimited).
      on_bad_record: "error" stops with file and line; "skip" skips and counts.
      reasoning_parser: how a thinking model's completion splits into reasoning and answer
        (rewards and tool calls read the answer only; reasoning that never closed is graded
        0; :mod:`rlflow.data.reasoning`): "none", "qwen3" (``<think>...</think>``), "auto"
        ("qwen3" for a Qwen3 model, else "none") or a "package.module:function" plug-in.
    """

    source: Literal["builtin", "jsonl", "parquet", "arrayrecord"] = "builtin"
    path: str = ""
    task: str = "digits"
    prompt_field: str = "question"
    answer_field: str = "answer"
    chat_template: Literal["hf", "plain", "none"] = "none"
    plain_template: str = "{prompt}"
    max_prompt_tokens: int = 64
    shuffle_seed: int = 0
    num_epochs: int = 0
    on_bad_record: Literal["error", "skip"] = "error"
    reasoning_parser: str = "auto"

    def __post_init__(self):
        _finite_floats(self, "data")
        _one_of(self.source, ("builtin", "jsonl", "parquet", "arrayrecord"), "data.source")
        _one_of(self.chat_template, ("hf", "plain", "none"), "data.chat_template")
        _one_of(self.on_bad_record, ("error", "skip"), "data.on_bad_record")
        if self.source != "builtin":
            _check(bool(self.path), "data.path", f"is required when data.source={self.source!r}")
        _positive(self.max_prompt_tokens, "data.max_prompt_tokens")
        _check(self.num_epochs >= 0, "data.num_epochs", f"must be >= 0, got {self.num_epochs}")
        _check("{prompt}" in self.plain_template, "data.plain_template",
               "must contain '{prompt}'")
        _check(self.reasoning_parser in ("none", "qwen3", "auto") or ":" in self.reasoning_parser,
               "data.reasoning_parser", f"must be 'none', 'qwen3', 'auto' or "
               f"'package.module:function', got {self.reasoning_parser!r}")


@dataclass(frozen=True)
class RewardConfig:
    """Reward functions (names from the registry in ``rlflow.data.rewards``) and weights.

    Each call runs in a reward worker process; one that raises, runs longer than
    ``timeout_s`` seconds (its worker is killed and replaced) or past ``memory_limit_mb``
    gives reward 0 for that sample; the failure is counted and logged with the sample id.

    Attributes:
      functions: reward function names: registered names (``rlflow.data.rewards``, or
        registered by a module in ``plugins``) or ``"package.module:function"`` /
        ``"path/file.py:function"`` references; unknown names are refused when the config
        is resolved. ``"http"`` and ``"judge"`` are rewards served over HTTP, set up in
        ``reward.http`` and ``reward.judge`` (:mod:`rlflow.data.http_scorer`; their own
        timeouts and retries, not ``timeout_s``).
      weights: one weight per function; the reward is the weighted sum.
      timeout_s: CPU seconds one reward call may use before its worker is killed and the
        sample scores 0 (counted as a timeout); CPU time, so that a loaded host does not cut a
        trivial call. A call that waits instead (sleep, lock, I/O) is cut after 10 x this of
        wall time (``rlflow.data.reward_workers.WALL_BACKSTOP_FACTOR``).
      num_workers: reward worker processes of the sampler (scoring overlaps decoding).
        0 calls the functions in the sampler process on a thread: for debugging only
        (a call that holds the GIL or allocates without bound is then not stopped).
      memory_limit_mb: memory one reward call may allocate, MiB: each reward worker's
        address space (RLIMIT_AS) is capped at what it maps after loading the functions plus
        this; a call past it scores 0 (counted as an error). 0: no limit.
      max_consecutive_errors: a function that fails (raises, returns a non-number or a
        NaN/inf one, runs out of memory) on this many calls in a row, without one success
        between, stops the run with its last error
        (``rlflow.data.rewards.RewardFunctionError``): it is broken, and training on its
        zeros would waste the run. A call past ``timeout_s`` counts as a failure too (a
        function that never returns is as broken as one that raises). 0: never stop.
      http: the served reward named ``"http"``: a reward model's endpoint
        (:class:`rlflow.config.HttpRewardConfig`).
      judge: the served reward named ``"judge"``: a chat model as judge behind
        ``/v1/chat/completions`` (:class:`rlflow.config.JudgeConfig`).
    """

    functions: Tuple[str, ...] = ("digits_match",)
    weights: Tuple[float, ...] = (1.0,)
    timeout_s: float = 5.0
    num_workers: int = 2
    memory_limit_mb: int = 4096
    max_consecutive_errors: int = 256
    http: HttpRewardConfig = field(default_factory=HttpRewardConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    def __post_init__(self):
        _finite_floats(self, "reward")
        for name in SERVED_REWARDS:
            _check(name not in self.functions or bool(getattr(self, name).url),
                   f"reward.{name}.url", f"is required: reward.functions names {name!r}, "
                   f"the reward served there")
        _check(len(self.functions) > 0, "reward.functions", "needs at least one reward function")
        _check(len(self.functions) == len(self.weights), "reward.weights",
               f"must have one weight per function ({len(self.functions)}), got {len(self.weights)}")
        _timeout(self.timeout_s, "reward.timeout_s")
        _check(self.num_workers >= 0, "reward.num_workers", f"must be >= 0, got {self.num_workers}")
        _check(self.memory_limit_mb >= 0, "reward.memory_limit_mb",
               f"must be >= 0 (0: no limit), got {self.memory_limit_mb}")
        _check(self.max_consecutive_errors >= 0, "reward.max_consecutive_errors",
               f"must be >= 0 (0: never stop), got {self.max_consecutive_errors}")
