"""The sampler's weight client: ``runtime.weight_transfer`` picks how a replica receives a
version (the counterpart of :mod:`rlflow.learner.publish`).

* ``"transfer"``: a :class:`rlflow.exchange.transfer.WeightSubscriber` that asks the
  learner's coordinator for offers and pulls them (``jax.experimental.transfer``); with
  ``sampler.num_replicas > 1`` it relays each version to ``runtime.relay_fanout`` other
  replicas. A multi-host learner (``learner.num_hosts > 1``) serves its shards from every
  host: :func:`rlflow.exchange.host_shards.host_shard_puller` pulls and assembles them (and
  relays each host's shards the same way: one relay tree per learner host).
* ``"orbax"``: :class:`rlflow.exchange.orbax_fallback.OrbaxWeightSubscriber` restores the
  versions the learner writes under the run folder.

Every client has ``poll() -> (version, params) | None``, ``cancel()`` (shutdown) and
``close()``; the sampler pulls on a background thread (:class:`rlflow.sampler.background.
WeightPuller`).
"""

from __future__ import annotations


def weight_subscriber(cfg, coordinator: str, target, *, consumer_id: str, weight_hosts=()):
    """The weight client of one sampler replica.

    Args:
      cfg: the experiment config (``runtime``, ``learner.num_hosts``,
        ``sampler.num_replicas``, ``buffer.token``, ``run_path``).
      coordinator: ``tcp://host:port`` of the learner's coordinator.
      target: where pulled weights go: a pytree of ``jax.ShapeDtypeStruct`` with shardings
        in the publisher's structure (:func:`rlflow.sampler.precision.pull_target`).
      consumer_id: this replica's name as the coordinator knows it (``sampler-<i>#<instance>``).
      weight_hosts: ``host:port`` of learner hosts 1..N-1's weight servers (the run
        control's reply), used with ``learner.num_hosts > 1``.

    Returns:
      ``WeightSubscriber``, ``HostShardPuller`` or ``OrbaxWeightSubscriber``.

    Raises:
      ValueError: ``weight_hosts`` does not name ``learner.num_hosts - 1`` hosts.
    """
    rt = cfg.runtime
    if rt.weight_transfer == "transfer":
        from rlflow.exchange.host_shards import host_shard_puller
        from rlflow.exchange.transfer import WeightSubscriber

        relay = rt.relay_fanout if cfg.sampler.num_replicas > 1 else 0
        kw = dict(consumer_id=consumer_id, token=cfg.buffer.token,
                  timeout_s=rt.transfer_timeout_s, retries=rt.transfer_retries,
                  bind_address=rt.bind_address, relay_fanout=relay,
                  relay_timeout_s=rt.transfer_timeout_s, weight_sync=rt.weight_sync)
        if cfg.learner.num_hosts > 1:            # pull every learner host's shards
            return host_shard_puller(coordinator, weight_hosts, target,
                                     num_hosts=cfg.learner.num_hosts, **kw)
        return WeightSubscriber(coordinator, target=target, **kw)
    from rlflow.exchange.orbax_fallback import OrbaxWeightSubscriber

    return OrbaxWeightSubscriber(cfg.run_path, target=target)
