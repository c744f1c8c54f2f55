"""Held-out evaluation: pure metric functions (:mod:`rlflow.eval.metrics`) and the offline
``rlflow eval`` command (:mod:`rlflow.eval.offline`)."""
