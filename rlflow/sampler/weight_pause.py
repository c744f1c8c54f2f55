"""The sampler's pause per weight version: the decode time a swap cost, by part.

A new version reaches the decode loop in three parts (``rlflow.sampler.program``):

- **pull**: the subscriber receives the version (``rlflow.sampler.background.WeightPuller``,
  a background thread: decoding goes on, but shares the host's cores and memory bandwidth
  with the pull; this is also the *transfer time*);
- **cast**: the pulled arrays become engine parameters (LoRA adapters applied, the cast to
  the engine's dtype, int8 quantisation, re-layout: ``RlflowEngine.load_params``), on the
  puller thread as well, or on the decode thread when the version was held back while a
  held-out evaluation decoded (then decoding stops for all of it);
- **install**: the decode step that swaps the new parameters in (a pointer swap, plus
  whatever the first step under new buffers costs).

The pause of a version is the decode time lost to these parts. A step that ran while the
pull or the cast ran (or that installed the version) lost ``max(0, d - b)`` seconds, ``d``
its duration and ``b`` the baseline step time: the median duration of the steps of the
same history that overlapped no part. Its loss is split over the parts in proportion to
the time the step overlapped each (the install step's time outside both windows goes to
install; a non-install step's time outside both windows is not counted). A part that ran
on the decode thread (``blocking``) adds its whole duration. The pause is the sum of its
parts, so ``pause_s == pull_s + cast_s + install_s`` and each is ``>= 0``.

This is the figure peers report as the sampler's pause per weight sync (prime-rl: 5.2 s of
a 7.9 s sync; marin: 5.15 s of 20.2 s): there the decode stops for the whole sync, here it
should be the install step's excess plus the contention of the background parts.
Timestamps are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

PARTS = ("pull", "cast", "install")


@dataclass(frozen=True)
class Window:
    """One part's run: ``[t0, t1]`` seconds; ``blocking``: it ran on the decode thread."""
    t0: float
    t1: float
    blocking: bool = False

    def __post_init__(self):
        if not self.t1 >= self.t0:
            raise ValueError(f"a window must end after it starts, got [{self.t0}, {self.t1}]")

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


def _overlap(a0: float, a1: float, w: Optional[Window]) -> float:
    return 0.0 if w is None else max(0.0, min(a1, w.t1) - max(a0, w.t0))


def pause_parts(steps: Sequence[tuple[float, float]], pull: Optional[Window],
                cast: Optional[Window], install_step: Optional[int] = None) -> dict:
    """Decode time lost to one version's swap, by part (see the module docstring).

    Args:
      steps: ``(t0, t1)`` of the decode steps around the swap (monotonic seconds), in
        order; those before the pull give the baseline.
      pull, cast: the parts' windows (None: the part did not happen, e.g. weights read
        from memory).
      install_step: index in ``steps`` of the step that swapped the version in (None: not
        yet installed; no install part).

    Returns:
      ``{"pull": s, "cast": s, "install": s, "pause": s, "baseline": s}`` (float seconds,
      each >= 0; ``pause`` is the sum of the three parts; ``baseline`` the step time the
      losses are measured against, 0 when no step overlapped nothing).

    Raises:
      ValueError: a step ends before it starts, or ``install_step`` is out of range.
    """
    t = np.asarray(steps, np.float64).reshape(-1, 2)
    if (t[:, 1] < t[:, 0]).any():
        raise ValueError("every decode step must end after it starts")
    if install_step is not None and not 0 <= install_step < len(t):
        raise ValueError(f"install_step {install_step} is not a step index (0..{len(t) - 1})")
    d = t[:, 1] - t[:, 0]
    ov_pull = np.array([_overlap(a, b, pull) for a, b in t])
    ov_cast = np.array([_overlap(a, b, cast) for a, b in t])
    touched = (ov_pull > 0) | (ov_cast > 0)
    if install_step is not None:
        touched[install_step] = True
    clean = d[~touched]
    baseline = float(np.median(clean)) if clean.size else 0.0
    excess = np.maximum(0.0, d - baseline)
    share = np.divide(excess, d, out=np.zeros_like(d), where=d > 0)
    out = {"pull": float(np.sum(share * ov_pull)), "cast": float(np.sum(share * ov_cast)),
           "install": 0.0}
    if install_step is not None:
        i = install_step
        out["install"] = float(share[i] * max(0.0, d[i] - ov_pull[i] - ov_cast[i]))
    for name, w in (("pull", pull), ("cast", cast)):
        if w is not None and w.blocking:       # decoding stopped for all of it
            out[name] += w.seconds
    out["pause"] = out["pull"] + out["cast"] + out["install"]
    out["baseline"] = baseline
    return out


#: Steps kept for the baseline before a version's pull starts.
BASELINE_STEPS = 64


class SwapPauseMeter:
    """Per-version pause figures for the sampler's status (a thin shell over
    :func:`pause_parts`).

    The puller thread (or the decode thread, ``blocking``) notes each version's pull and
    cast windows (:meth:`note`); the decode thread notes every step (:meth:`step`), with
    the version it swapped in, if any; at that step the version's figures are computed and
    become :meth:`metrics` (the newest swapped version's). Thread-safe.

    Args:
      max_steps: steps kept (older ones are forgotten; a pull longer than that many steps
        counts only its last ``max_steps``).
    """

    def __init__(self, max_steps: int = 65536):
        self._steps: collections.deque = collections.deque(maxlen=max_steps)
        self._windows: dict[int, dict[str, Window]] = {}
        self._lock = threading.Lock()
        self.latest: dict = {}

    def note(self, version: int, part: str, t0: float, t1: float,
             blocking: bool = False) -> None:
        """``part`` ("pull" or "cast") of ``version`` ran over ``[t0, t1]``."""
        if part not in ("pull", "cast"):
            raise ValueError(f"part must be 'pull' or 'cast', got {part!r}")
        with self._lock:
            self._windows.setdefault(int(version), {})[part] = Window(t0, t1, blocking)

    def step(self, t0: float, t1: float, swapped_to: Optional[int] = None) -> None:
        """One decode step ran over ``[t0, t1]``; ``swapped_to``: the version it swapped in."""
        self._steps.append((t0, t1))
        if swapped_to is None:
            return
        with self._lock:
            windows = self._windows.pop(int(swapped_to), {})
            for v in [v for v in self._windows if v < swapped_to]:   # skipped versions
                del self._windows[v]
        pull, cast = windows.get("pull"), windows.get("cast")
        starts = [w.t0 for w in (pull, cast) if w is not None] or [t0]
        steps = list(self._steps)
        first = next((i for i, (_, b) in enumerate(steps) if b > min(starts)), len(steps) - 1)
        steps = steps[max(0, first - BASELINE_STEPS):]
        parts = pause_parts(steps, pull, cast, install_step=len(steps) - 1)
        self.latest = dict(parts, version=int(swapped_to),
                           transfer=pull.seconds if pull is not None else 0.0,
                           cast_wall=cast.seconds if cast is not None else 0.0)

    def metrics(self) -> dict:
        """``sampler/weight_pause_s`` and its parts ``sampler/weight_pause_{pull,cast,
        install}_s``, beside ``sampler/weight_transfer_s`` (the pull's wall time),
        ``sampler/weight_cast_s`` (the cast's wall time) and ``sampler/weight_pause_version``
        (the version they are for); empty before the first swap."""
        m = self.latest
        if not m:
            return {}
        out = {f"sampler/weight_pause_{p}_s": m[p] for p in PARTS}
        out.update({"sampler/weight_pause_s": m["pause"],
                    "sampler/weight_transfer_s": m["transfer"],
                    "sampler/weight_cast_s": m["cast_wall"],
                    "sampler/weight_pause_version": float(m["version"])})
        return out
