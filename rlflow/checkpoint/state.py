"""What one learner checkpoint holds in memory (:class:`LearnerCheckpoint`) and its error type.

The on-disk items are listed in :mod:`rlflow.checkpoint`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import jax
import numpy as np

PyTree = Any


class CheckpointError(ValueError):
    """A checkpoint is missing, or does not fit what the caller restores it into."""


class DamagedCheckpointError(CheckpointError):
    """A committed checkpoint's files cannot be read (truncated, emptied, altered on disk):
    the message names the step folder, the underlying error and the ways out.

    Attributes:
      folder: the step folder; step: its step; reason: the underlying error in one line
        (``Type: first line``); earlier: the complete steps before it, ascending.

    Without ``message`` the message is :attr:`headline` + ": " + ``way`` (the way out).
    """

    def __init__(self, message: str = "", *, folder: str = "", step: int = -1,
                 reason: str = "", earlier: tuple = (), way: str = ""):
        self.folder, self.step, self.reason, self.earlier = folder, step, reason, tuple(earlier)
        super().__init__(message or f"{self.headline}: {way}")

    @property
    def headline(self) -> str:
        """What is damaged, without the way out (which depends on who reads it)."""
        return (f"{self.folder}: checkpoint step {self.step} cannot be read ({self.reason}); "
                f"its files are damaged")


@dataclass
class LearnerCheckpoint:
    """What one learner checkpoint holds (see :mod:`rlflow.checkpoint` for the on-disk items).

    Attributes:
      step: optimiser steps completed; the next step to run is ``step + 1``.
      params: policy parameters, a pytree of ``jax.Array`` (``nnx.State`` from
        ``nnx.split(model, nnx.Param)``).
      opt_state: optax state (``None``: not saved / not restored).
      value: PPO value head parameters (``nnx.State``, :mod:`rlflow.learner.value`), or
        ``None`` (group estimators: nothing saved).
      rngs: named PRNG keys, typed (``jax.random.key``) or raw ``uint32`` (``PRNGKey``);
        each must be fully replicated (the same on every host).
      data_state: prompt iterator state from grain's ``get_state()`` (dict or bytes), or None.
      policy_version: version of ``params``; the learner's step count unless set.
      extra: JSON-able loop counters (epoch, samples seen, dropped groups, ...).
      metadata: run metadata (:func:`rlflow.checkpoint.run_metadata`).

    Raises:
      CheckpointError: ``step`` is not an int >= 0.
    """

    step: int
    params: PyTree
    opt_state: PyTree = None
    value: PyTree = None
    rngs: Mapping[str, jax.Array] = field(default_factory=dict)
    data_state: Any = None
    policy_version: Optional[int] = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.step, (int, np.integer)) or self.step < 0:
            raise CheckpointError(f"LearnerCheckpoint.step: must be an int >= 0, got {self.step!r}")
        self.step = int(self.step)
        if self.policy_version is None:
            self.policy_version = self.step
