"""Run metadata saved with every checkpoint (the ``meta`` item): who saved it, with what.

JSON types only; the resolved config is stored with its secrets redacted
(:func:`rlflow.config.secrets.redact_config`).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import platform
from typing import Optional

import jax

FORMAT_VERSION = 1
# Distributions whose versions are recorded (``None`` when one is not installed).
VERSIONED = ("rlflow", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain")


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_metadata(cfg=None, mesh=None, **extra) -> dict:
    """Run metadata saved with every checkpoint (JSON types only).

    Args:
      cfg: the resolved ``ExperimentConfig`` (stored as ``dataclasses.asdict``, secrets
        redacted), or None.
      mesh: the learner's ``jax.sharding.Mesh`` (axis names and sizes are stored), or None.
      **extra: more JSON-able fields.

    Returns:
      ``{"format_version", "saved_at" (ISO UTC), "host", "process_count", "device_kind",
      "versions": {distribution: version or None}}`` plus ``"config"``, ``"mesh"``
      (axis name -> size) when given, and ``extra``.
    """
    meta = {
        "format_version": FORMAT_VERSION,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "host": platform.node(),
        "process_count": jax.process_count(),
        "device_kind": jax.devices()[0].device_kind,
        "versions": {n: _dist_version(n) for n in VERSIONED},
    }
    if cfg is not None:
        from rlflow.config.secrets import redact_config

        meta["config"] = redact_config(dataclasses.asdict(cfg))   # secrets stay out
    if mesh is not None:
        meta["mesh"] = {str(k): int(v) for k, v in mesh.shape.items()}
    meta.update(extra)
    return meta
