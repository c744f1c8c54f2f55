"""The run folder and what is written into it: layout checks, identity, metrics, report, the
run summary (:mod:`rlflow.run.summary`) and the lock that keeps one launcher per run folder
(:mod:`rlflow.run.run_lock`)."""
