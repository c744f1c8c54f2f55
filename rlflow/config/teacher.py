"""The teacher section: on-policy distillation from a frozen teacher model."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from rlflow.config.validation import DTYPES, _check, _finite_floats, _one_of

TEACHER_MODES = ("distill", "add")


@dataclass(frozen=True)
class TeacherConfig:
    """On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language
    Models: Learning from Self-Generated Mistakes" (GKD); Thinking Machines Lab 2025,
    "On-Policy Distillation"): a frozen teacher scores the tokens the student sampled, and
    the sampled reverse KL ``A_t = log pi_teacher(y_t) - log pi_behaviour(y_t)`` is a
    per-token advantage (:mod:`rlflow.learner.distill`).

    The teacher runs on the learner side, on the learner's devices and mesh (its parameters
    sharded by the same logical-axis rules): a forward-only jitted function per batch,
    frozen, never in the optimiser state or a checkpoint (:mod:`rlflow.learner.teacher`).
    A separate teacher program on its own devices (as the sampler is) is a later option.
    Teacher and student must share the tokenizer (same vocabulary, special tokens and model
    vocabulary size), checked before the run starts.

    Attributes:
      path: local Hugging Face folder of the teacher (config.json, safetensors, tokenizer
        files). Empty: no teacher (the default).
      dtype: the teacher's stored and compute dtype ("bfloat16" halves its memory).
      mode: "distill": the distillation advantage alone (``kl_coef * A_t``), no reward
        needed (rewards are still scored and logged for reporting); "add": added to the RL
        advantage, ``A_rl + kl_coef * A_t``.
      kl_coef: weight of the distillation advantage (> 0).
      baseline: "none": ``A_t`` as defined above; "mean": the batch's mean ``A_t`` over its
        loss positions subtracted (a constant REINFORCE baseline: the same expected gradient,
        less variance; a student far from its teacher, e.g. a random one, otherwise pushes
        probability into rarely sampled tokens and can collapse,
        :func:`rlflow.learner.distill.distill_advantages`).
    """

    path: str = ""
    dtype: Literal["float32", "bfloat16"] = "float32"
    mode: Literal["distill", "add"] = "distill"
    kl_coef: float = 1.0
    baseline: Literal["none", "mean"] = "none"

    def __post_init__(self):
        _finite_floats(self, "teacher")
        _one_of(self.dtype, DTYPES, "teacher.dtype")
        _one_of(self.mode, TEACHER_MODES, "teacher.mode")
        _one_of(self.baseline, ("none", "mean"), "teacher.baseline")
        _check(math.isfinite(self.kl_coef) and self.kl_coef > 0, "teacher.kl_coef",
               f"must be > 0, got {self.kl_coef}")
        if self.path:
            _check(os.path.isfile(os.path.join(self.path, "config.json")), "teacher.path",
                   f"{self.path!r} is not a Hugging Face model folder (no config.json)")

    @property
    def enabled(self) -> bool:
        return bool(self.path)
