"""The learner program on a slice of several hosts: host 0 leads, hosts 1..N-1 follow.

``learner.num_hosts > 1``: every host runs the same jitted step over one global mesh
(:mod:`rlflow.learner.multihost`), but only host 0 runs :class:`rlflow.learner.program.
LearnerProgram` (ring buffer, run control, prompt ledger, metrics, run folder). It tells the
other hosts what to do next by a small broadcast (:class:`HostCommands`, one int32 pair)
before each collective piece of work, and the followers (:func:`follower_main`) do the same::

    host 0 (LearnerProgram)                     hosts 1..N-1 (follower_main)
    Learner(cfg) on the global mesh             Learner(cfg) on the global mesh
    resume (orbax, every host reads)            resume
    LearnerHosts: weight server per host,       LearnerHosts (same collective)
      addresses all-gathered
    PUBLISH v   -> each host serves its shards  publish this host's shards
    STEP        -> distribute_batch + step      distribute_batch(None) + step
    SAVE / SAVE_FINAL -> orbax save, every host save (JSON items: host 0 only)
    DONE                                        exit 0

Weights out: each host publishes its own transfer unit
(:func:`rlflow.exchange.host_shards.host_units`) on its own ``WeightPublisher``; host 0's is
offered by its run coordinator, each follower's by a plain
:class:`rlflow.exchange.coordinator.Coordinator`; host 0 tells the samplers the followers'
coordinator addresses in every status reply (``ControlReply.weight_hosts``) and each sampler
pulls from every host and assembles its own layout (``HostShardPuller``).

Faults: a follower never stops by itself on SIGTERM (it waits for host 0's SAVE_FINAL /
DONE, so the exit checkpoint is a whole one); a host that dies breaks the next collective
(gloo: "Connection closed by peer") and every other host exits with that error;
``rlflow train`` names the dead host (:mod:`rlflow.launcher.learner_hosts`).
"""

from __future__ import annotations

import logging
import signal

import jax
import numpy as np
from jax.experimental import multihost_utils

from rlflow import checkpoint as ckpt_lib
from rlflow.control import programs_common as pc
from rlflow.system.ports import advertised_host

log = logging.getLogger("rlflow.learner")

STEP, PUBLISH, SAVE, SAVE_FINAL, DONE = 1, 2, 3, 4, 5
OP_NAMES = {STEP: "STEP", PUBLISH: "PUBLISH", SAVE: "SAVE", SAVE_FINAL: "SAVE_FINAL",
            DONE: "DONE"}
ADDRESS_BYTES = 256     # an advertised "host:port" fits in this many bytes


class HostCommands:
    """Host 0 -> every host: the next collective piece of work, ``(op, arg)`` int32."""

    def __init__(self):
        self.leader = jax.process_index() == 0

    def send(self, op: int, arg: int = 0) -> None:
        """Host 0 only."""
        if not self.leader:
            raise RuntimeError("only learner host 0 sends commands")
        multihost_utils.broadcast_one_to_all(np.array([op, arg], np.int32), is_source=True)

    def receive(self) -> tuple[int, int]:
        """Hosts 1..N-1: wait for host 0's next command.

        Raises: RuntimeError: an unknown op (names it).
        """
        got = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(2, np.int32),
                                                              is_source=False))
        op, arg = int(got[0]), int(got[1])
        if op not in OP_NAMES:
            raise RuntimeError(f"learner host {jax.process_index()}: unknown command {op} "
                               "from learner host 0")
        return op, arg


def gather_addresses(address: str) -> list[str]:
    """Every host's ``address`` (a collective), in host order.

    Raises: ValueError: an address longer than ``ADDRESS_BYTES``.
    """
    raw = address.encode()
    if len(raw) > ADDRESS_BYTES:
        raise ValueError(f"address {address!r} is longer than {ADDRESS_BYTES} bytes")
    mine = np.frombuffer(raw.ljust(ADDRESS_BYTES, b"\0"), np.uint8).astype(np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine))      # [hosts, ADDRESS_BYTES]
    return [bytes(row.astype(np.uint8)).rstrip(b"\0").decode() for row in every]


def gather_relay_totals(offers) -> np.ndarray:
    """Every host's ``offers.totals()`` (a collective; zeros for a host without relays):
    float64 ``[hosts, len(rlflow.exchange.relay.TOTALS)]``, host order."""
    from rlflow.exchange.relay import TOTALS

    mine = (offers.totals() if hasattr(offers, "totals")
            else np.zeros(len(TOTALS), np.float64))
    # float32 on the wire (jax without x64 would cut int64 byte counts to int32): metrics
    # only, 1e-7 relative rounding
    every = multihost_utils.process_allgather(np.asarray(mine, np.float32))
    return np.asarray(every, np.float64).reshape(-1, len(TOTALS))


class LearnerHosts:
    """One learner host's part in the multi-host program (built on every host, at the same
    point: after the learner and its resume).

    Args:
      cfg: the experiment config.
      bind_host: host the followers' weight coordinators bind.
      publisher: this host's ``WeightPublisher`` (host 0: the one its run coordinator
        offers; followers: served here by a plain coordinator).
      offers: host 0: what its run coordinator offers from (``Publisher.offers``, a
        ``RelayOffers`` with relays); followers make their own (None).

    Attributes:
      weight_hosts: ``host:port`` of the weight coordinators of hosts 1..N-1 (what the
        samplers pull the other shards from).
      relay_totals: float64 ``[hosts, len(rlflow.exchange.relay.TOTALS)]``, every host's
        relay figures as of the last publish (zero rows: no relays), or None before it.
    """

    def __init__(self, cfg, bind_host: str, publisher, offers=None):
        from rlflow.exchange.coordinator import Coordinator

        self.cfg, self.publisher, self.offers = cfg, publisher, offers
        self.commands = HostCommands()
        self.coordinator = None
        self.relay_totals = None
        address = ""
        if not self.commands.leader:
            from rlflow.learner.publish import relay_offers

            self.offers = relay_offers(cfg, publisher)
            self.coordinator = Coordinator(self.offers, bind_address=bind_host,
                                           token=cfg.buffer.token).start()
            address = f"{advertised_host(bind_host)}:{self.coordinator.port}"
        self.weight_hosts = gather_addresses(address)[1:]
        log.info("learner host %d of %d; weight coordinators of hosts 1..: %s",
                 jax.process_index(), jax.process_count(), self.weight_hosts)

    def publish(self, version: int, params) -> None:
        """This host's shards of ``params``, in ``cfg.published_dtype``
        (:func:`rlflow.learner.publish.published_params`), become version ``version`` (host
        0 first sends PUBLISH)."""
        from rlflow.exchange.host_shards import host_units
        from rlflow.learner.publish import casts_for_sampler, published_params

        if self.commands.leader:
            self.commands.send(PUBLISH, version)
        self.relay_totals = gather_relay_totals(self.offers)
        if casts_for_sampler(self.cfg):      # the sampler's dtype, cast on every host
            params = published_params(params, self.cfg.published_dtype)
        self.publisher.publish(version, host_units(params))

    def dispatch(self, learner, batch, *, checked: bool = False) -> tuple[dict, dict]:
        """Host 0: start one step on ``batch`` over every host (``multihost.dispatch_step``):
        returns ``(step metrics as device arrays, distribution info)`` before the step ends;
        the followers run ``multihost.train_step``."""
        from rlflow.learner import multihost

        self.commands.send(STEP)
        return multihost.dispatch_step(learner, batch, checked=checked)

    def before_save(self, final: bool) -> None:
        """Host 0: every host saves the checkpoint it is about to save."""
        self.commands.send(SAVE_FINAL if final else SAVE)

    def done(self) -> None:
        """Host 0: the run is over; the followers exit."""
        self.commands.send(DONE)

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()
        if hasattr(self.publisher, "close"):
            self.publisher.close()


def follower_main(cfg, endpoints: pc.Endpoints) -> None:
    """The learner program on hosts 1..N-1: follow host 0's commands until DONE.

    SIGTERM is noted, never raised: host 0 (stopped by the same signal) sends SAVE_FINAL and
    DONE, so this host takes its part of the exit checkpoint.

    Raises:
      jax.errors.JaxRuntimeError / RuntimeError: a collective failed (another host died).
      rlflow.learner.batch.BatchError: host 0 rejected a batch (host 0 raises it too).
    """
    from rlflow.learner.trainer import Learner

    signal.signal(signal.SIGTERM, lambda signum, frame: log.info(
        "SIGTERM: waiting for learner host 0's exit checkpoint"))
    from rlflow.learner.publish import keeps_params

    host = jax.process_index()
    learner = Learner(cfg, keep_params=keeps_params(cfg))
    checkpointer = ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(cfg.run_path), cfg.checkpoint)
    restored = learner.resume(checkpointer)
    # samplers reach this host's weight server: loopback when host 0's is (one machine),
    # else every interface (a pod; off loopback the token is required, rlflow.exchange.wire)
    from rlflow.exchange.wire import is_loopback

    from rlflow.learner.publish import weight_publisher

    bind = "127.0.0.1" if is_loopback(pc.split_address(endpoints.coordinator)[0]) else "0.0.0.0"
    hosts = LearnerHosts(cfg, bind, weight_publisher(cfg, bind,
                                                     params_kept=learner.keeps_params))
    log.info("learner host %d ready at version %d (resumed: %s)", host, learner.version,
             restored is not None)
    try:
        while True:
            op, arg = hosts.commands.receive()
            if op == STEP:
                from rlflow.learner import multihost

                multihost.train_step(learner, None)
            elif op == PUBLISH:
                hosts.publish(arg, learner.params)
            elif op in (SAVE, SAVE_FINAL):
                checkpointer.wait()     # every host sees the same committed steps
                ck = learner.checkpoint(metadata=ckpt_lib.run_metadata(cfg, learner.mesh))
                if op == SAVE_FINAL:
                    checkpointer.save_final(ck)
                else:
                    checkpointer.save(ck, force=True)
            else:       # DONE
                log.info("learner host %d finished at version %d", host, learner.version)
                return
    finally:
        hosts.close()
        checkpointer.close()
