"""The sampler program's weights: the subscriber, the first version, and each swap between
decode steps (:class:`WeightSwaps`, a part of :class:`rlflow.sampler.program.SamplerProgram`).

A version arrives on the puller thread (:meth:`WeightSwaps._on_weights`), is cast / quantised /
re-laid for the engine and handed to the batcher, which uses it from its next decode step on;
while a held-out evaluation decodes it is held back and swapped in once the evaluation's prompts
are decoded. Each part's time is noted for the pause per version
(:class:`rlflow.sampler.weight_pause.SwapPauseMeter`).
"""

from __future__ import annotations

import logging
import time

from rlflow.exchange.host_shards import log_weights_digest
from rlflow.sampler.batching import ContinuousBatcher
from rlflow.sampler.lanes import DecodeLanes
from rlflow.sampler.precision import pull_target
from rlflow.sampler.subscribe import weight_subscriber

log = logging.getLogger("rlflow.sampler")

FIRST_WEIGHTS_TIMEOUT_S = 600.0


class SamplerError(RuntimeError):
    """The sampler cannot go on (the message says why); reported to the learner too."""


class WeightSwaps:
    """The weight half of the sampler program (its attributes are the program's: ``cfg``,
    ``engine``, ``batcher``, ``subscriber``, ``adapters``, ``pause``, ``evals``, ...)."""

    def _subscriber(self, coord: str, model):
        from flax import nnx

        target = pull_target(nnx.state(model, nnx.Param) if self.adapters is None
                             else self.adapters.target, self.cfg.published_dtype)
        hosts = (self.control.status(version=-1).weight_hosts
                 if self.cfg.learner.num_hosts > 1 else ())
        return weight_subscriber(self.cfg, coord, target, weight_hosts=hosts,
                                 consumer_id=f"{self.name}#{self.control.instance}")

    def _first_weights(self, reply) -> ContinuousBatcher | DecodeLanes:
        """Wait for the learner's first published version (never anything older, e.g. an
        earlier run's orbax folder) and load it."""
        deadline = time.monotonic() + FIRST_WEIGHTS_TIMEOUT_S
        while True:
            got = self.subscriber.poll() if reply.published_version >= 0 else None
            if got is not None:
                version, params = got
                log_weights_digest(log, version, params)
                params = self._engine_params(params)
                log.info("loaded weights version %d from the learner", version)
                self._note_swap(version, 0.0)
                self.version = version
                if self.lanes > 1:
                    return DecodeLanes(self.engine, params, version, lanes=self.lanes)
                return ContinuousBatcher(self.engine, params, version, episodes=self.episodes)
            if time.monotonic() > deadline:
                raise SamplerError(f"no weights published by the learner within "
                                   f"{FIRST_WEIGHTS_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
            reply = self._status()

    def _note_swap(self, version: int, pull_s: float) -> None:
        self.swap = {"sync/swap_version": version, "sync/swap_time": time.time(),
                     "sync/pull_s": pull_s}        # one reference swap (read by the main thread)

    def _engine_params(self, params):
        """Pulled weights -> engine parameters (LoRA: adapters applied to the base)."""
        return params if self.adapters is None else self.adapters.engine_params(params)

    def _on_weights(self, version: int, params, pull_s: float) -> None:
        """Puller thread: a new version arrived (laid out on this program's mesh); held
        back while a held-out evaluation decodes (:meth:`_release_held_weights`)."""
        t1 = time.monotonic()
        self.pause.note(version, "pull", t1 - pull_s, t1)
        with self._weights_lock:
            if self.evals is not None and self.evals.decoding:
                self._held_weights = (version, params, pull_s)
                return
            self._swap_in(version, params, pull_s)

    def _swap_in(self, version: int, params, pull_s: float, blocking: bool = False) -> None:
        """Cast / quantise / re-lay ``params`` for the engine and hand them to the batcher
        (used from its next decode step on); ``blocking``: on the decode thread."""
        log_weights_digest(log, version, params)
        t0 = time.monotonic()
        self.batcher.update_params(self._engine_params(params), version)
        self.pause.note(version, "cast", t0, time.monotonic(), blocking=blocking)
        self.version = version     # every group admitted from now on starts with it
        self._note_swap(version, pull_s)

    def _release_held_weights(self) -> None:
        """Main thread: the evaluation's prompts are decoded; swap in weights held back."""
        with self._weights_lock:
            if self._held_weights is not None and not self.evals.decoding:
                held, self._held_weights = self._held_weights, None
                self._swap_in(*held, blocking=True)

    def _start_eval(self, requested: int) -> None:
        """Run the held-out evaluation the learner named, at this replica's version."""
        with self._weights_lock:        # no swap between reading the version and submitting
            self.evals.start(requested, self.version, self.batcher)
