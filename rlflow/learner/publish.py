"""The learner's weight publishing: ``runtime.weight_transfer`` picks how a version reaches
the samplers.

* ``"transfer"``: a :class:`rlflow.exchange.transfer.WeightPublisher` (``jax.experimental.
  transfer`` server) whose offers the coordinator hands out; with ``sampler.num_replicas > 1``
  and ``runtime.relay_fanout > 0`` the offers go through :class:`rlflow.exchange.relay.
  RelayOffers` (replicas pull from replicas, so the learner sends O(fanout) copies, not N).
* ``"orbax"``: the fallback, each version written under the run folder
  (:mod:`rlflow.exchange.orbax_fallback`); the coordinator only reports versions.

A multi-host learner (``learner.num_hosts > 1``) publishes through its
:class:`rlflow.learner.hosts.LearnerHosts`: every host serves its own weight shards, each
behind the same choice of offers (:func:`relay_offers`: one relay tree per host).

With ``"transfer"`` the learner's step keeps its params (:func:`keeps_params`): the transfer
server sends a version straight from the step's output buffers, with no publish copy.
"""

from __future__ import annotations

import shutil
import time

from rlflow.models.lora import tree_bytes


def keeps_params(cfg) -> bool:
    """Whether the learner's train step keeps its params (``Learner(keep_params=...)``, never
    donated) so that a published version is served without a copy: with
    ``runtime.weight_transfer = "transfer"``. The orbax fallback writes each version to
    files instead, so its step donates them (one params-sized buffer less)."""
    return cfg.runtime.weight_transfer == "transfer"


class _NoOffers:
    """Offer source of the orbax fallback: the coordinator only reports versions."""

    def __init__(self):
        self.version = -1

    def offer(self, consumer: str, have_version: int) -> dict:
        return {"version": self.version}


def relay_offers(cfg, publisher):
    """What a weight coordinator offers from ``publisher``: with several sampler replicas and
    ``runtime.relay_fanout > 0`` a :class:`rlflow.exchange.relay.RelayOffers` (a relay tree
    per version: this host sends ~fanout x its shards' bytes, whatever the replica count),
    else the publisher itself (every replica pulls from it). Learner host 0's run
    coordinator and the followers' weight coordinators use the same rule."""
    rt = cfg.runtime
    if cfg.sampler.num_replicas > 1 and rt.relay_fanout > 0:
        from rlflow.exchange.relay import RelayOffers

        return RelayOffers(publisher, fanout=rt.relay_fanout,
                           assign_timeout_s=rt.transfer_timeout_s,
                           num_consumers=cfg.sampler.num_replicas)
    return publisher


class Publisher:
    """Publishes each version by ``cfg.runtime.weight_transfer`` (see the module docstring).

    Attributes:
      impl: the transfer server's publisher or the orbax folder's.
      offers: what the coordinator asks for offers (``offer(consumer, have_version)``).
      publish_time: wall time (``time.time()``, seconds) each version was published.
      bytes: bytes of the last published version (LoRA: the adapters only).
      hosts: the multi-host learner's ``LearnerHosts`` (set by the program), or None.

    ``params_kept``: the learner's step keeps the params it publishes
    (``Learner.keeps_params``): the transfer server then sends them without a copy; else it
    publishes a copy (the step donates them).
    """

    def __init__(self, cfg, bind_host: str, *, params_kept: bool):
        rt = cfg.runtime
        if rt.weight_transfer == "transfer":
            from rlflow.exchange.transfer import WeightPublisher

            self.impl = WeightPublisher(bind_address=bind_host,
                                        pull_timeout_s=rt.transfer_timeout_s,
                                        donated=not params_kept,
                                        layout=rt.transfer_layout,
                                        weight_sync=rt.weight_sync,
                                        delta_full_every=rt.delta_full_every)
            self.offers = relay_offers(cfg, self.impl)
        else:
            from rlflow.exchange.orbax_fallback import OrbaxWeightPublisher, weights_dir

            # Versions left by an earlier (interrupted) run are not this run's: a resumed
            # learner republishes from its checkpoint's version.
            shutil.rmtree(weights_dir(cfg.run_path), ignore_errors=True)
            self.impl = OrbaxWeightPublisher(cfg.run_path, keep_last=rt.weights_keep_last)
            self.offers = _NoOffers()
        self.publish_time: dict[int, float] = {}
        self.bytes = 0             # bytes of the last published version (LoRA: adapters only)
        self.hosts = None          # LearnerHosts of a multi-host learner: per-host shards

    def publish(self, version: int, params) -> None:
        """Offer ``params`` (the learner's parameter tree of ``jax.Array``) as policy
        ``version`` (the steps taken; increasing from one call to the next)."""
        self.bytes = tree_bytes(params)
        if self.hosts is None:
            self.impl.publish(version, params)
        else:
            self.hosts.publish(version, params)
        self.offers.version = version
        self.publish_time[version] = time.time()

    def transfer_metrics(self) -> dict:
        """The ``transfer/*`` relay figures: every learner host's relay tree as of the last
        publish (``rlflow.exchange.relay.all_hosts_metrics``) on a multi-host learner, else
        this host's offers' own; ``{}`` without relays. With ``runtime.weight_sync="delta"``
        on one host also ``transfer/delta_offers``, ``transfer/full_offers``,
        ``transfer/full_fallbacks`` (counts) and ``transfer/delta_over_full`` (the newest
        version's delta bytes over its full bytes)."""
        totals = getattr(self.hosts, "relay_totals", None)
        if totals is not None:
            from rlflow.exchange.relay import all_hosts_metrics

            return all_hosts_metrics(totals)
        out = self.offers.metrics() if hasattr(self.offers, "metrics") else {}
        if getattr(self.impl, "weight_sync", "full") == "delta":   # this host's delta sync
            out.update({f"transfer/{k}": float(v) for k, v in self.impl.sync.items()})
            if self.impl.delta_nbytes and self.impl.nbytes:   # the newest version has a delta
                out["transfer/delta_over_full"] = self.impl.delta_nbytes / self.impl.nbytes
        return out

    def close(self) -> None:
        if hasattr(self.impl, "close"):
            self.impl.close()
