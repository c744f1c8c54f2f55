"""Data between the two programs: rollouts sampler -> learner, weights learner -> sampler.

* ``records``: the rollout group record: schema validation and binary framing (no pickle).
* ``ring``: the bounded in-process ring of groups (blocking, timeouts, drop-oldest, metrics).
* ``buffer``: the ring served over ZeroMQ (server in the learner, clients in the samplers).
* ``wire``: the ZeroMQ request/reply plumbing and token check shared by the services.
* ``layout``: weight shard layouts as JSON; pull specs and re-layout on the sampler.
* ``transfer`` / ``coordinator``: ``jax.experimental.transfer`` publisher, subscriber and the
  coordinator that hands out ``(address, uuid, version, layout)`` offers.
* ``orbax_fallback``: weights through ``<run>/weights/<version>`` checkpoint folders.
"""
