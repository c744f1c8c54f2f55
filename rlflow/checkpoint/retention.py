"""Which checkpoints are kept: the newest ``keep_last``, plus the best one by a metric.

orbax preservation policies (``LatestN``, and ``BestN`` when
``CheckpointConfig.keep_best_metric`` is set); a checkpoint whose metric is missing or
not finite never counts as the best.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Optional

from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

from rlflow.config import CheckpointConfig


def best_metric_fn(metric: str, mode: str) -> Callable[[Mapping[str, float]], float]:
    """Score for orbax's ``best_mode="max"``: the metric, negated when ``mode == "min"``;
    ``-inf`` when the metric is missing or NaN/inf."""
    sign = 1.0 if mode == "max" else -1.0

    def best_fn(metrics, _metric=metric, _sign=sign):
        value = float(metrics.get(_metric, math.nan))
        return _sign * value if math.isfinite(value) else -math.inf

    return best_fn


def preservation(cfg: CheckpointConfig) -> tuple[pp.AnyPreservationPolicy, Optional[Callable]]:
    """The preservation policy of ``cfg`` and its best-checkpoint score function (or None).

    Returns:
      ``(policy, best_fn)``: ``LatestN(keep_last)``, with ``BestN(n=1)`` over ``best_fn``
      when ``cfg.keep_best_metric`` is set (``best_fn`` None otherwise).
    """
    policies = [pp.LatestN(n=cfg.keep_last)]
    best_fn = None
    if cfg.keep_best_metric:
        best_fn = best_metric_fn(cfg.keep_best_metric, cfg.keep_best_mode)
        policies.append(pp.BestN(get_metric_fn=best_fn, n=1,
                                 keep_checkpoints_without_metrics=False))
    return pp.AnyPreservationPolicy(policies), best_fn
