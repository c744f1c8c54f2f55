"""On-policy distillation: the sampled reverse KL to a teacher as a per-token advantage.

The student samples ``y ~ pi_behaviour`` (the sampler's policy); a frozen teacher scores
the same tokens. The reverse KL ``KL(pi_student || pi_teacher) = E_{y ~ pi_student}[log
pi_student(y) - log pi_teacher(y)]`` estimated on the sampled tokens gives, per token
(Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD), eq. 2 with the reverse KL, the divergence sampled from the
student's own generations; Thinking Machines Lab 2025, "On-Policy Distillation": the
per-token reverse KL used as the advantage of an importance-sampled policy gradient)::

    A_t = log pi_teacher(y_t | y_<t) - log pi_behaviour(y_t | y_<t)        (detached)

Maximising ``sum_t A_t log pi(y_t)`` with this advantage minimises the sampled reverse KL;
the student's logprob is the behaviour (old) policy's, the one the tokens were sampled
with, so the advantage is a constant of the step as an RL advantage is.

Pure functions on ``[B, L]`` arrays aligned with ``TrainBatch.targets`` (numpy by default,
``xp=jnp`` works as well).
"""

from __future__ import annotations

from typing import Literal

import numpy as np


def distill_advantages(teacher_logprobs, behaviour_logprobs, loss_mask, rl_advantages=None, *,
                       mode: Literal["distill", "add"] = "distill", kl_coef: float = 1.0,
                       baseline: Literal["none", "mean"] = "none", xp=np):
    """The training advantage of every loss position with a teacher.

    Args:
      teacher_logprobs: ``[B, L]`` float, ``log pi_teacher(targets[b, t])``.
      behaviour_logprobs: ``[B, L]`` float, the sampler's logprob of the same tokens.
      loss_mask: ``[B, L]`` bool, the positions in the loss (sampled tokens; an episode's
        environment tokens, padding and dropped samples are 0).
      rl_advantages: ``[B, L]`` float, the RL advantage per position (needed with
        ``mode="add"``; ignored with ``"distill"``).
      mode: ``"distill"``: ``kl_coef * A_t``; ``"add"``: ``rl_advantages + kl_coef * A_t``.
      kl_coef: weight of the distillation advantage.
      baseline: ``"none"``: ``A_t`` as above; ``"mean"``: ``A_t - mean(A)``, the mean over
        the batch's loss positions subtracted (a constant baseline, Williams 1992 REINFORCE:
        ``E[grad log pi] = 0``, so the expected gradient is unchanged up to the ``O(1/N)``
        share of each token in the mean, while the variance drops: far from the teacher,
        every sampled token's ``A_t`` is strongly negative, and the uncentred estimate pushes
        probability into whatever token is rarely sampled).

    Returns: ``[B, L]`` float32 advantages, 0 outside ``loss_mask`` (the masked entries of
    the inputs, which may be anything, never reach the result).

    Raises: ValueError for an unknown ``mode`` or ``baseline``, or ``"add"`` without
    ``rl_advantages``.
    """
    if mode not in ("distill", "add"):
        raise ValueError(f"mode must be 'distill' or 'add', got {mode!r}")
    if baseline not in ("none", "mean"):
        raise ValueError(f"baseline must be 'none' or 'mean', got {baseline!r}")
    mask = xp.asarray(loss_mask, bool)
    zero = xp.zeros(mask.shape, xp.float32)
    a = xp.where(mask, xp.asarray(teacher_logprobs, xp.float32)
                 - xp.asarray(behaviour_logprobs, xp.float32), zero)
    if baseline == "mean":
        n = xp.maximum(mask.sum(), 1).astype(xp.float32)
        a = xp.where(mask, a - a.sum(dtype=xp.float32) / n, zero)
    out = xp.float32(kl_coef) * a
    if mode == "add":
        if rl_advantages is None:
            raise ValueError("mode='add' needs rl_advantages")
        out = out + xp.where(mask, xp.asarray(rl_advantages, xp.float32), zero)
    return out.astype(xp.float32)


def sampled_reverse_kl(teacher_logprobs, behaviour_logprobs, loss_mask, xp=np) -> float:
    """Mean over the loss positions of ``log pi_behaviour(y_t) - log pi_teacher(y_t)``: the
    sampled (k1) estimate of ``KL(pi_student || pi_teacher)`` per token (``nan`` without a
    loss position). Inputs as :func:`distill_advantages`."""
    mask = xp.asarray(loss_mask, bool)
    n = int(mask.sum())
    if n == 0:
        return float("nan")
    diff = xp.where(mask, xp.asarray(behaviour_logprobs, xp.float64)
                    - xp.asarray(teacher_logprobs, xp.float64), 0.0)
    return float(diff.sum() / n)
