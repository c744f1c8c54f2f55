"""The catalogue of rlflow's metric names: every name an ``rlflow train`` step must log, with
its unit and meaning (:data:`METRIC_SPECS`, :data:`REQUIRED_METRICS`), the fixed buckets of
the staleness histogram and of the mismatch diagnostics' policy lag, and the staleness
histogram itself (:func:`staleness_histogram`). Written by :class:`rlflow.run.metrics.
MetricsWriter` (which re-exports these names), read by ``rlflow report`` and the run-folder
check (:func:`rlflow.run.folder.validate_run_folder`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# Staleness histogram: the fraction of consumed samples that lag the learner by 0, 1, 2
# and >= 3 policy versions (fixed buckets so every run logs the same names).
STALENESS_BUCKETS = (0, 1, 2)
STALENESS_HIST = tuple(f"staleness/frac_{k}" for k in STALENESS_BUCKETS) + (
    f"staleness/frac_{STALENESS_BUCKETS[-1] + 1}plus",)

# Policy-lag buckets of the mismatch diagnostics (rlflow.learner.rollout_correction): the
# metric suffixes of samples that lag the learner by 0, 1 and >= 2 versions.
LAG_BUCKETS = ("lag0", "lag1", "lag2plus")

# name -> (unit, meaning). Times are wall-clock seconds measured since the previous step.
METRIC_SPECS: dict[str, tuple[str, str]] = {
    "reward/mean": ("reward", "mean reward of the samples consumed this step"),
    "reward/std": ("reward", "standard deviation (ddof=0) of those rewards"),
    "reward/min": ("reward", "smallest reward"),
    "reward/max": ("reward", "largest reward"),
    "reward/accuracy": ("fraction", "samples the verifier marked correct"),
    "response/length_mean": ("tokens", "mean completion length (EOS included)"),
    "response/length_max": ("tokens", "longest completion"),
    "response/truncation_rate": ("fraction", "completions cut by sampler.max_tokens"),
    "policy/kl": ("nats", "KL(current || reference), the learner's estimator, token mean"),
    "policy/entropy": ("nats", "current-policy token entropy, token mean"),
    "policy/clip_frac_low": ("fraction", "tokens with ratio clipped at 1 - clip_low"),
    "policy/clip_frac_high": ("fraction", "tokens with ratio clipped at 1 + clip_high"),
    "policy/is_weight_mean": ("ratio", "importance weight pi_old / pi_behaviour, token mean"),
    "policy/is_weight_min": ("ratio", "smallest importance weight"),
    "policy/is_weight_max": ("ratio", "largest importance weight (before the cap)"),
    "staleness/mean": ("versions", "learner version minus sample version, mean"),
    "staleness/max": ("versions", "largest staleness consumed"),
    **{name: ("fraction", "staleness histogram bucket") for name in STALENESS_HIST},
    "learner/step_time_s": ("s", "wall time of the learner's train step"),
    "learner/compile_s": ("s", "part of the step spent compiling its shape or waiting for "
                          "its background compile (0 once compiled)"),
    "learner/idle_frac": ("fraction", "learner time spent waiting for rollouts"),
    "perf/mfu": ("fraction", "model FLOPs utilisation of the train step: model FLOPs "
                 "(rlflow.run.perf, PaLM appendix B) / (step time x chips x peak FLOP/s)"),
    "perf/tokens_per_s_per_chip": ("tokens/s", "real tokens trained per second of step "
                                   "compute per learner device"),
    "perf/model_flops_per_s_per_chip": ("FLOP/s", "the step's model FLOPs per second per "
                                        "learner device"),
    "batch/model_flops": ("FLOPs", "model FLOPs of the step's batch (6N + 12 L H D T per "
                          "token, rlflow.run.perf)"),
    "batch/tokens": ("tokens", "real (not padding) tokens of the step's batch"),
    "perf/time_wait_s": ("s", "part of the step's wall time spent waiting for rollouts"),
    "perf/time_batch_s": ("s", "part spent building the batch"),
    "perf/time_compute_s": ("s", "part spent in the train step (= learner/step_time_s)"),
    "perf/time_publish_s": ("s", "part spent publishing the new weights"),
    "learner/padding_fraction": ("fraction", "padded positions of the one-row-per-sample batch"),
    "learner/packed_padding_fraction": ("fraction", "padded positions of the packed batch "
                                        "(learner.packing) the step computes on"),
    "sampler/tokens_per_s": ("tokens/s", "decoded tokens per second over the step's interval "
                             "(sampler/tokens_per_s_run: over the run)"),
    "sampler/slot_occupancy": ("fraction", "decode slots holding a live sequence, mean over "
                               "the step's interval"),
    "sampler/idle_frac": ("fraction", "sampler time blocked on the buffer or on weights, "
                          "over the step's interval"),
    "sampler/tokens_per_s_per_chip": ("tokens/s", "decoded tokens per second per device of "
                                      "the replicas' meshes, over the step's interval"),
    "sync/weight_sync_s": ("s", "publish-to-swap time of the latest weight version"),
    "sync/sampler_pause_s": ("s", "decode time lost to the latest weight swap (pull, cast, "
                             "install; = sampler/weight_pause_s, rlflow.sampler.weight_pause)"),
    "buffer/fill": ("fraction", "groups held / buffer.capacity"),
    "buffer/producer_wait_s": ("s", "time the sampler waited on a full buffer"),
    "buffer/consumer_wait_s": ("s", "time the learner waited on an empty buffer"),
}
REQUIRED_METRICS: tuple[str, ...] = tuple(METRIC_SPECS)


def staleness_histogram(staleness: Sequence[int] | np.ndarray) -> dict[str, float]:
    """Staleness metrics of one step's consumed samples.

    Args:
      staleness: int ``[N]``, learner version minus each sample's policy version (>= 0).

    Returns:
      ``staleness/mean``, ``staleness/max`` and the :data:`STALENESS_HIST` fractions
      (they sum to 1).

    Raises:
      ValueError: empty input, non-integer values, or a negative staleness (a sample from
        a version the learner has not published yet).
    """
    s = np.asarray(staleness)
    if s.ndim != 1 or s.size == 0:
        raise ValueError(f"staleness must be a non-empty 1-D array, got shape {s.shape}")
    if s.dtype.kind not in "iu":
        raise ValueError(f"staleness must hold integers (versions), got dtype {s.dtype}")
    if (s < 0).any():
        raise ValueError(f"staleness must be >= 0, got {s[s < 0][:5].tolist()} (a sample "
                         "tagged with a version newer than the learner's)")
    out = {"staleness/mean": float(s.mean()), "staleness/max": float(s.max())}
    for k, name in zip(STALENESS_BUCKETS, STALENESS_HIST):
        out[name] = float((s == k).mean())
    out[STALENESS_HIST[-1]] = float((s > STALENESS_BUCKETS[-1]).mean())
    return out
