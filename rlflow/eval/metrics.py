"""Evaluation metrics: pure functions over one evaluation's scored samples.

An evaluation samples ``k`` completions of each of ``P`` prompts. Inputs are arrays
``[P, k]`` (one row per prompt, samples in order); a sample is *correct* when its reward
reaches the accuracy threshold (:func:`rlflow.control.programs_common.accuracy_threshold`).

* pass@k: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
  Trained on Code"), eq. 1: ``1 - C(n - c, k) / C(n, k)`` per problem with ``n`` samples of
  which ``c`` are correct, averaged over problems; computed as the product
  ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (the paper's numerically stable form), never
  with factorials.
* maj@k: majority vote (self-consistency, Wang et al. 2022): per prompt the most frequent
  extracted final answer among the first ``k`` samples (ties: the answer seen first); the
  prompt scores 1 when a sample giving that answer is correct.
* mean reward, mean completion length (tokens) and truncation rate (completions that hit
  ``max_tokens``) over all samples.
"""

from __future__ import annotations

import collections
from typing import Mapping, Sequence

import numpy as np


def pass_at_k(num_samples, num_correct, k: int) -> np.ndarray:
    """Unbiased pass@k per problem (Chen et al. 2021, eq. 1).

    Args:
      num_samples: int ``[P]`` (or scalar): samples drawn per problem, ``n >= k``.
      num_correct: int ``[P]`` (or scalar): correct ones among them, ``0 <= c <= n``.
      k: samples considered (``k >= 1``).

    Returns:
      float64 ``[P]``: ``1 - C(n - c, k) / C(n, k)``, as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``
      (1.0 when ``n - c < k``).

    Raises:
      ValueError: ``k < 1``, ``n < k``, ``c < 0`` or ``c > n`` (names the first bad problem).
    """
    n = np.atleast_1d(np.asarray(num_samples, np.int64))
    c = np.atleast_1d(np.asarray(num_correct, np.int64))
    if n.shape != c.shape:
        raise ValueError(f"pass_at_k: num_samples {n.shape} and num_correct {c.shape} differ "
                         "in shape")
    if k < 1:
        raise ValueError(f"pass_at_k: k must be >= 1, got {k}")
    bad = np.flatnonzero((n < k) | (c < 0) | (c > n))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"pass_at_k: problem {i} has n={int(n[i])} samples and c={int(c[i])} "
                         f"correct; expected n >= k={k} and 0 <= c <= n")
    out = np.ones(n.shape, np.float64)
    for i, (ni, ci) in enumerate(zip(n.tolist(), c.tolist())):
        if ni - ci >= k:
            i_range = np.arange(ni - ci + 1, ni + 1, dtype=np.float64)
            out[i] = 1.0 - float(np.prod(1.0 - k / i_range))
    return out


def majority_correct(answers: Sequence[Sequence[str]], correct) -> np.ndarray:
    """maj@k per prompt: 1.0 when the most frequent answer (ties: the first seen) of the
    prompt's samples belongs to a correct sample, else 0.0.

    Args:
      answers: ``P`` rows of ``k`` extracted final answers (strings, compared after
        stripping whitespace; an empty answer is a vote like any other).
      correct: bool ``[P, k]``.

    Returns:
      float64 ``[P]``.

    Raises:
      ValueError: ``answers`` and ``correct`` differ in shape.
    """
    correct = np.asarray(correct, bool)
    if correct.ndim != 2 or len(answers) != correct.shape[0] or any(
            len(row) != correct.shape[1] for row in answers):
        raise ValueError(f"majority_correct: answers ({len(answers)} rows) and correct "
                         f"{correct.shape} must both be [prompts, samples]")
    out = np.zeros(len(answers), np.float64)
    for p, row in enumerate(answers):
        votes = collections.Counter(a.strip() for a in row)     # insertion order breaks ties
        winner = max(votes, key=lambda a: votes[a])
        out[p] = float(any(ok for a, ok in zip(row, correct[p]) if a.strip() == winner))
    return out


def eval_metrics(rewards, correct, lengths, truncated, answers: Sequence[Sequence[str]],
                 components: Mapping[str, object] | None = None) -> dict[str, float]:
    """One evaluation's metrics.

    Args:
      rewards: float ``[P, k]`` total rewards.
      correct: bool ``[P, k]``.
      lengths: int ``[P, k]`` completion lengths in tokens.
      truncated: bool ``[P, k]``: the completion reached ``max_tokens``.
      answers: ``P`` rows of ``k`` extracted final answers (for maj@k).
      components: reward function name -> float ``[P, k]`` unweighted rewards of that
        function (optional).

    Returns:
      ``{"eval/reward_mean", "eval/pass@1", "eval/pass@<k>", "eval/maj@<k>",
      "eval/completion_length", "eval/truncation_rate", "eval/num_prompts",
      "eval/num_samples"}`` as floats (pass@k and maj@k only for k > 1; maj@1 equals
      pass@1), and ``"eval/reward/<name>"``, the mean of each of ``components`` (for a
      0/1 reward function: the fraction of samples it accepts, its accuracy).

    Raises:
      ValueError: the arrays are not all ``[P, k]`` with ``P >= 1`` (names a bad component).
    """
    rewards = np.asarray(rewards, np.float64)
    correct = np.asarray(correct, bool)
    lengths = np.asarray(lengths, np.float64)
    truncated = np.asarray(truncated, bool)
    shape = rewards.shape
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1 or any(
            a.shape != shape for a in (correct, lengths, truncated)):
        raise ValueError(f"eval_metrics: rewards {rewards.shape}, correct {correct.shape}, "
                         f"lengths {lengths.shape}, truncated {truncated.shape} must all be "
                         "[prompts, samples] with at least one of each")
    p, k = shape
    n = np.full(p, k)
    c = correct.sum(axis=1)
    out = {"eval/reward_mean": float(rewards.mean()),
           "eval/pass@1": float(pass_at_k(n, c, 1).mean()),
           "eval/completion_length": float(lengths.mean()),
           "eval/truncation_rate": float(truncated.mean()),
           "eval/num_prompts": float(p), "eval/num_samples": float(k)}
    for name, values in (components or {}).items():
        values = np.asarray(values, np.float64)
        if values.shape != shape:
            raise ValueError(f"eval_metrics: components[{name!r}] is {values.shape}, "
                             f"expected [prompts, samples] {shape}")
        out[f"eval/reward/{name}"] = float(values.mean())
    if k > 1:
        out[f"eval/pass@{k}"] = float(pass_at_k(n, c, k).mean())
        out[f"eval/maj@{k}"] = float(majority_correct(answers, correct).mean())
    return out


def metrics_line(metrics: Mapping[str, float]) -> str:
    """``eval/pass@1 0.4200  eval/maj@4 0.5000 ...``: the metrics on one line, sorted."""
    return "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
