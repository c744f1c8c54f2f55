"""The contract between the two programs: what the learner program and the sampler program
agree on and both import; it imports neither of them (``tests/unit/test_layering.py``).

* :mod:`rlflow.control.run_control`: run control on the learner's coordinator socket
  (status, admission rule, prompt leases, heartbeats, weight offers).
* :mod:`rlflow.control.ledger`: the prompt ledger, the one owner of the prompt stream.
* :mod:`rlflow.control.replicas`: liveness of the sampler replicas.
* :mod:`rlflow.control.replica_metrics`: replica figures as learner metrics.
* :mod:`rlflow.control.evals`: the held-out evaluation schedule during training.
* :mod:`rlflow.control.seeds`: request seeds (the prompt ledger's and the evaluation's).
* :mod:`rlflow.control.programs_common`: what every program does at start (config, run
  folder, signals, tokenizer).
"""
