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

Versions go out in the sampler's dtype (``ExperimentConfig.published_dtype``): a bf16
sampler beside a float32 learner is sent each version rounded to bf16 once, on the learner's
devices (:func:`published_params`), half the bytes of the master weights and the only bits
the sampler uses; a replica's weights are bitwise the learner's cast.

With ``"transfer"`` and versions in the learner's own dtype, the learner's step keeps its
params (:func:`keeps_params`): the transfer server sends a version straight from the step's
output buffers, with no publish copy. A cast version is a fresh copy, the publisher's own, so
the step then donates its params.
"""

from __future__ import annotations

import functools
import math
import shutil
import time

import jax
import jax.numpy as jnp

from rlflow.models.lora import in_adapter, tree_bytes


def casts_for_sampler(cfg) -> bool:
    """Whether versions are published in another dtype than the learner's master weights
    (``cfg.published_dtype != model.param_dtype``: a bf16 sampler beside a float32 learner)."""
    return cfg.published_dtype != cfg.model.param_dtype


def keeps_params(cfg) -> bool:
    """Whether the learner's train step keeps its params (``Learner(keep_params=...)``, never
    donated) so that a published version is served without a copy: with
    ``runtime.weight_transfer = "transfer"`` and versions in the learner's own dtype. The
    orbax fallback writes each version to files instead, and a version cast to the
    sampler's dtype is a copy already (:func:`published_params`), so those steps donate
    their params (one params-sized buffer less)."""
    return cfg.runtime.weight_transfer == "transfer" and not casts_for_sampler(cfg)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _cast_copy(leaves: list, cast: tuple, dtype: str) -> list:
    want = jnp.dtype(dtype)
    # jnp.copy: a fresh buffer also for a leaf kept as it is (the step may donate it)
    return [x.astype(want) if c else jnp.copy(x) for x, c in zip(leaves, cast)]


def _casts(path, x) -> bool:
    """Whether :func:`published_params` casts this leaf (a model leaf of a float dtype)."""
    return not in_adapter(path) and jnp.issubdtype(x.dtype, jnp.floating)


def published_bytes(params, dtype: str) -> int:
    """Bytes of :func:`published_params` of ``params`` (arrays or ``ShapeDtypeStruct``)."""
    return int(sum(math.prod(x.shape) * (jnp.dtype(dtype) if _casts(p, x) else x.dtype).itemsize
                   for p, x in jax.tree_util.tree_flatten_with_path(params)[0]))


def published_params(params, dtype: str):
    """What the learner publishes of ``params`` (a pytree of ``jax.Array``, any sharding):
    every floating leaf cast to ``dtype`` (round to nearest even, ``astype``), except LoRA
    adapter leaves (inside ``*_lora`` modules), which keep their float32; other leaves
    copied. One jitted call per set of devices the leaves live on; each output keeps its
    input's sharding and is a new buffer (never an alias of ``params``, which the next
    train step may donate). A multi-host learner calls it on every host (one SPMD
    program)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    groups: dict[frozenset, list[int]] = {}
    for i, (_, x) in enumerate(flat):
        groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
    out = [None] * len(flat)
    for idx in groups.values():
        cast = tuple(_casts(*flat[i]) for i in idx)
        for i, y in zip(idx, _cast_copy([flat[i][1] for i in idx], cast, str(dtype))):
            out[i] = y
    return jax.tree_util.tree_unflatten(treedef, out)


def weight_publisher(cfg, bind_host: str, *, params_kept: bool):
    """This host's ``WeightPublisher`` (``runtime.transfer_layout``, ``runtime.weight_sync``);
    ``params_kept``: the learner's step keeps its params (``Learner.keeps_params``), so they
    are sent without a copy. Versions cast to the sampler's dtype are the publisher's own
    copies (:func:`published_params`): never copied again."""
    from rlflow.exchange.transfer import WeightPublisher

    rt = cfg.runtime
    donated = not params_kept and not casts_for_sampler(cfg)
    return WeightPublisher(bind_address=bind_host, pull_timeout_s=rt.transfer_timeout_s,
                           donated=donated, layout=rt.transfer_layout,
                           weight_sync=rt.weight_sync, delta_full_every=rt.delta_full_every)


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
      bytes: bytes of the last published version (LoRA: the adapters only), in
        :attr:`dtype`.
      dtype: the dtype model weights are published in (``cfg.published_dtype``).
      cast: whether that is not the learner's ``model.param_dtype`` (a copy is published).
      hosts: the multi-host learner's ``LearnerHosts`` (set by the program), or None.

    ``params_kept``: the learner's step keeps the params it publishes
    (``Learner.keeps_params``): the transfer server then sends them without a copy; else it
    publishes a copy (the step donates them).
    """

    def __init__(self, cfg, bind_host: str, *, params_kept: bool):
        rt = cfg.runtime
        self.dtype = cfg.published_dtype
        self.cast = casts_for_sampler(cfg)
        if rt.weight_transfer == "transfer":
            self.impl = weight_publisher(cfg, bind_host, params_kept=params_kept)
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
        ``version`` (the steps taken; increasing from one call to the next), in
        :attr:`dtype` (``cfg.published_dtype``: :func:`published_params`)."""
        self.bytes = published_bytes(params, self.dtype) if self.cast else tree_bytes(params)
        if self.hosts is not None:          # every host casts its part (LearnerHosts.publish)
            self.hosts.publish(version, params)
        else:
            self.impl.publish(version, published_params(params, self.dtype)
                              if self.cast else params)
        self.offers.version = version
        self.publish_time[version] = time.time()

    def transfer_metrics(self) -> dict:
        """The ``transfer/*`` relay figures: every learner host's relay tree as of the last
        publish (``rlflow.exchange.relay.all_hosts_metrics``) on a multi-host learner, else
        this host's offers' own; ``{}`` without relays. With ``runtime.weight_sync="delta"``
        on one host also ``transfer/delta_offers``, ``transfer/full_offers``,
        ``transfer/full_fallbacks``, ``transfer/pending_answers`` (counts),
        ``transfer/delta_over_full`` (the last delta's bytes over a full version's) and
        ``transfer/delta_encode_s`` (seconds the background thread spent on the last
        version, off the learner's thread: :mod:`rlflow.exchange.delta_worker`)."""
        totals = getattr(self.hosts, "relay_totals", None)
        if totals is not None:
            from rlflow.exchange.relay import all_hosts_metrics

            return all_hosts_metrics(totals)
        out = self.offers.metrics() if hasattr(self.offers, "metrics") else {}
        if getattr(self.impl, "weight_sync", "full") == "delta":   # this host's delta sync
            out.update({f"transfer/{k}": float(v) for k, v in self.impl.sync.items()})
            if self.impl.delta_nbytes and self.impl.nbytes:   # the newest version has a delta
                out["transfer/delta_over_full"] = self.impl.delta_nbytes / self.impl.nbytes
            out["transfer/delta_encode_s"] = float(self.impl.delta_encode_s)
        return out

    def close(self) -> None:
        if hasattr(self.impl, "close"):
            self.impl.close()
