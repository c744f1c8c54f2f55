"""Data between the two programs: rollouts sampler -> learner, weights learner -> sampler.

* ``records``: the rollout group record: schema validation and binary framing (no pickle).
* ``ring``: the bounded in-process ring of groups (blocking, timeouts, drop-oldest, metrics).
* ``buffer``: the ring served over ZeroMQ (server in the learner, clients in the samplers).
* ``wire``: the ZeroMQ request/reply plumbing and token check shared by the services.
* ``layout``: weight shard layouts as JSON; pull specs and re-layout on the sampler.
* ``transfer`` / ``subscriber`` / ``coordinator``: the ``jax.experimental.transfer`` publisher
  (learner), subscriber (sampler; ``transfer_server``: the server both run and the pull
  errors) and the coordinator that hands out ``(address, uuid, version, layout)`` offers.
* ``delta`` / ``delta_worker``: delta weight sync's codec, and the learner's background thread
  that makes each version's delta.
* ``relay`` / ``host_shards``: the relay tree of replicas, and a multi-host learner's shards.
* ``orbax_fallback``: weights through ``<run>/weights/<version>`` checkpoint folders.
"""
