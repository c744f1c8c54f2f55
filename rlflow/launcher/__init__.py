"""The launcher: start, supervise and watch the programs of a run. It may import every floor
below it, the two programs included; only ``console/`` imports it (``tests/unit/test_layering.py``).

* :mod:`rlflow.launcher.supervisor`: ``rlflow train``: start and supervise the learner and the
  sampler replicas on one machine; :mod:`rlflow.launcher.children`: its child processes
  (environment, start, stop, exit and failure texts); :mod:`rlflow.launcher.child_logs`: what
  a child's log says (its failure report).
* :mod:`rlflow.launcher.launch`: ``python -m rlflow.launcher.launch``: one program in one
  process (started by the supervisor, or by the TPU launch scripts on every host of a pod);
  :mod:`rlflow.launcher.learner_hosts`: the learner on several processes.
* :mod:`rlflow.launcher.run_watch`: the launcher's view of a running learner (progress,
  stall notices; the summary it writes is :mod:`rlflow.run.summary`);
  :mod:`rlflow.launcher.progress`: the progress line.
* :mod:`rlflow.launcher.local_hosts`: a local stand-in for a multi-host slice (K JAX
  processes on this machine, for the multi-host tests and benchmark).
"""
