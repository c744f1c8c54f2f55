"""The runtime: how the programs run together.

* :mod:`rlflow.runtime.supervisor`: ``rlflow train``: start and supervise the learner and the
  sampler replicas on one machine; :mod:`rlflow.runtime.children`: its child processes
  (environment, start, stop, exit and failure texts).
* :mod:`rlflow.runtime.launch`: ``python -m rlflow.runtime.launch``: one program in one process
  (started by the supervisor, or by the TPU launch scripts on every host of a pod).
* :mod:`rlflow.control.run_control`: run control between the programs (status, admission rule,
  prompt leases, heartbeats) on the learner's coordinator socket.
* :mod:`rlflow.control.ledger`: the prompt ledger, the one owner of the prompt stream.
* :mod:`rlflow.control.replicas`: liveness of the sampler replicas.
* :mod:`rlflow.control.replica_metrics`: replica figures as learner metrics.
* :mod:`rlflow.runtime.run_watch`: the launcher's view of a run (progress, summary).
* :mod:`rlflow.run.run_lock`: one ``rlflow train`` per run folder at a time.
"""
