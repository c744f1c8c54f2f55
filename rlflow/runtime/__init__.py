"""The runtime: how the programs run together.

* :mod:`rlflow.runtime.launch`: ``rlflow train`` and ``python -m rlflow.runtime.launch``:
  start and supervise the learner and the sampler replicas.
* :mod:`rlflow.runtime.control`: run control between the programs (status, admission rule,
  prompt leases, heartbeats) on the learner's coordinator socket.
* :mod:`rlflow.runtime.ledger`: the prompt ledger, the one owner of the prompt stream.
* :mod:`rlflow.runtime.replicas`: liveness of the sampler replicas.
* :mod:`rlflow.runtime.metrics`: replica figures as learner metrics.
* :mod:`rlflow.runtime.run_watch`: the launcher's view of a run (progress, summary).
"""
