"""Held-out evaluation as a library (the floor of ``exchange/``, ``checkpoint/`` and
``envs/``; it imports neither program): pure metric functions (:mod:`rlflow.eval.metrics`) and
the held-out prompts, prompt records and their aggregation (:mod:`rlflow.eval.scoring`). Its
users: the learner's schedule (:mod:`rlflow.control.evals`), each replica's runner
(:mod:`rlflow.sampler.eval_runner`) and the ``rlflow eval`` command
(:mod:`rlflow.console.offline_eval`)."""
