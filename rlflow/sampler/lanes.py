"""Decode lanes: the sampler's slots split into independent continuous batchers whose decode
calls run at the same time, one thread each (``sampler.decode_lanes``).

Why: on the CPU backend a decode step of a small model is ~140 small XLA ops that run
mostly one after another on one core; a second core adds almost nothing to one call
(benchmarks/README.md, "Decode step"). Two calls over half the slots each, dispatched from
two threads (JAX releases the GIL while XLA runs), use both cores: on the 2-core host of
``benchmarks/sampler_throughput.py`` 2 lanes of 8 slots decode ~1.4x the tokens per second
of one 16-slot batcher. On a TPU or GPU a device runs one program at a time, so lanes only
add per-call overhead there, and so they do on CPU for a tiny model (hidden 64: 2 lanes
~0.87x of one), whose call is mostly overhead. ``decode_lanes = 0`` (the default) lets
:func:`lane_count` choose from those measurements. Tunix and verl scale
the same way across devices with data-parallel rollout workers; lanes are that within one
CPU process.

Each lane is a :class:`rlflow.sampler.batching.ContinuousBatcher` with ``num_slots / L``
slots over the one shared engine (its jitted functions are compiled once and called from
every lane; the decode state, KV cache included, is the lane's own)::

    lanes = DecodeLanes(engine, params, version, lanes=2)   # engine: num_slots / 2 slots
    lanes.submit(request)          # to the lane with the fewest samples queued or decoding
    groups = lanes.step()          # one step() of every lane with work, concurrently

A request's samples stay in one lane (they share its prefill). A new version
(:meth:`update_params`) is placed once and taken by every lane before its next decode call.
Sampling does not depend on the slot or lane: sample ``i`` of a request draws from its own
random stream (``rlflow.sampler.sampling.request_uniforms``), so the tokens are those one
batcher would sample, up to the float rounding of a different batch size.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Optional, Sequence

from rlflow.sampler.batching import BatchCounters, CompletedGroup, ContinuousBatcher, Request


# Smallest residual width at which 2 lanes measured faster than one on 2 CPU cores
# (benchmarks/sampler_throughput.py: hidden 256 ~1.4x; hidden 64 ~0.87x).
AUTO_LANES_MIN_HIDDEN = 256


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. after ``runtime.pin_cpus``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def lane_count(decode_lanes: int, num_slots: int, *, hidden_size: int, backend: str,
               cpus: int, multi_turn: bool, replicas: int = 1) -> int:
    """The number of decode lanes the sampler runs (``sampler.decode_lanes``).

    Args:
      decode_lanes: the configured value; >= 1 is returned as it is, 0 means choose.
      num_slots: ``sampler.num_slots``.
      hidden_size: the model's residual width (a proxy for the work of one decode call).
      backend: ``jax.default_backend()`` of the sampler ("cpu", "tpu", "gpu").
      cpus: CPUs the sampler process may run on (:func:`available_cpus`).
      multi_turn: episodes with an environment (lanes run single-turn requests only).
      replicas: ``sampler.num_replicas``; a CPU run starts them all on this machine, where
        they share those CPUs (pinned or not), so each counts ``cpus // replicas``.

    Returns:
      for 0: 2 when every condition measured to pay holds (CPU backend, >= 2 CPUs per replica,
      ``hidden_size >= AUTO_LANES_MIN_HIDDEN``, an even ``num_slots >= 4``, single-turn),
      else 1.
    """
    if decode_lanes >= 1:
        return decode_lanes
    pays = (backend == "cpu" and cpus // replicas >= 2 and hidden_size >= AUTO_LANES_MIN_HIDDEN
            and num_slots >= 4 and num_slots % 2 == 0 and not multi_turn)
    return 2 if pays else 1


class DecodeLanes:
    """``lanes`` continuous batchers over one engine, stepped concurrently (module doc).

    The interface is :class:`ContinuousBatcher`'s (``submit``, ``update_params``, ``step``,
    ``run``, ``has_work``, ``num_queued``, ``num_active``, ``reset_cache``, ``counters``,
    ``version``), so the sampler program drives either.

    Args:
      engine: the engine, built with ``sampler.num_slots / lanes`` slots
        (``engine.max_concurrent_decodes``).
      params / version / on_long_prompt: as :class:`ContinuousBatcher`.
      lanes: number of lanes (>= 2).

    Raises:
      ValueError: ``lanes`` < 2.
    """

    def __init__(self, engine, params=None, version: int = 0,
                 on_long_prompt: Optional[str] = None, *, lanes: int):
        if lanes < 2:
            raise ValueError(f"DecodeLanes needs >= 2 lanes, got {lanes} (use a "
                             "ContinuousBatcher for one)")
        self.engine = engine
        placed = engine.load_params(params, version)        # placed once, shared by all
        self.lanes = [ContinuousBatcher(engine, placed, version, on_long_prompt)
                      for _ in range(lanes)]
        self._pool = ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="rlflow-lane")

    # ------------------------------------------------------------------ input
    def submit(self, request: Request, resumed=()) -> None:
        """Queue a request's samples (``resumed``: as :meth:`ContinuousBatcher.submit`) on
        the lane with the fewest samples queued or decoding (the first of those on a tie).
        Raises: as :meth:`ContinuousBatcher.submit`."""
        lane = min(self.lanes, key=lambda b: b.num_queued + b.num_active)
        lane.submit(request, resumed)

    def partials(self) -> list:
        """Every lane's :meth:`ContinuousBatcher.partials`, one list."""
        return [p for lane in self.lanes for p in lane.partials()]

    def update_params(self, params, version: int) -> None:
        """New weights for every lane, placed on the engine's mesh once; each lane uses them
        from its next decode call on (thread-safe)."""
        placed = self.engine.load_params(params, version)
        for lane in self.lanes:
            lane.update_params(placed, version)

    # ------------------------------------------------------------------ state
    @property
    def version(self) -> int:
        """The oldest policy version a lane decodes with (all equal between steps)."""
        return min(lane.version for lane in self.lanes)

    @property
    def num_queued(self) -> int:
        """Samples waiting for a slot, over all lanes."""
        return sum(lane.num_queued for lane in self.lanes)

    @property
    def num_active(self) -> int:
        """Slots holding a sequence, over all lanes."""
        return sum(lane.num_active for lane in self.lanes)

    @property
    def has_work(self) -> bool:
        """Some lane has samples queued or decoding, or results not yet returned."""
        return any(lane.has_work for lane in self.lanes)

    @property
    def counters(self) -> "LaneCounters":
        """The lanes' :class:`BatchCounters` summed field by field, as a live view (like a
        batcher's own counters, a reference taken before a step reads the new sums after it)."""
        return LaneCounters(self.lanes)

    def reset_cache(self) -> None:
        """Free every lane's decode state. Raises: RuntimeError while sequences are in
        flight (as :meth:`ContinuousBatcher.reset_cache`)."""
        for lane in self.lanes:
            lane.reset_cache()

    # ------------------------------------------------------------------ loop
    def step(self) -> list[CompletedGroup]:
        """One :meth:`ContinuousBatcher.step` of every lane with work, each on its own
        thread, all at once; returns their completed groups, lane by lane.

        Raises: the first lane's error (in lane order) after every lane's step returned.
        """
        busy = [lane for lane in self.lanes if lane.has_work]
        if len(busy) <= 1:
            return busy[0].step() if busy else []
        futures = [self._pool.submit(lane.step) for lane in busy]
        wait(futures)                      # every lane's step has returned (or raised)
        out = []
        for f in futures:
            out.extend(f.result())
        return out

    run = ContinuousBatcher.run     # submit, then step until nothing is left (same loop)

    def close(self) -> None:
        """Stop the lanes' threads (after the step in flight, if any)."""
        self._pool.shutdown(wait=True)


_COUNTER_FIELDS = frozenset(f.name for f in dataclasses.fields(BatchCounters))


class LaneCounters:
    """A live view of several batchers' counters: each :class:`BatchCounters` field (and
    ``occupancy``) is the sum over the lanes at the time it is read."""

    def __init__(self, lanes: Sequence[ContinuousBatcher]):
        self._lanes = lanes

    def __getattr__(self, name: str) -> int:
        if name not in _COUNTER_FIELDS:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        return sum(getattr(lane.counters, name) for lane in self._lanes)

    occupancy = BatchCounters.occupancy     # the same formula, over the summed fields
