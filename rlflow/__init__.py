"""rlflow: asynchronous RL for language models on JAX, the sampler and the learner as separate
programs (``../shared/DESIGN.md``; the README's "How it is built").

Its folders are floors; a module imports only from its own floor or below, ground up
(``tests/unit/test_layering.py`` holds the table and checks every import):

1. ground: :mod:`rlflow.system` (process plumbing) and :mod:`rlflow.mesh`;
2. :mod:`rlflow.config`;
3. :mod:`rlflow.models`, :mod:`rlflow.data`, :mod:`rlflow.run`;
4. :mod:`rlflow.exchange`, :mod:`rlflow.checkpoint`, :mod:`rlflow.envs`, :mod:`rlflow.eval`;
5. :mod:`rlflow.control` (the contract between the programs) and :mod:`rlflow.export`;
6. :mod:`rlflow.sampler` and :mod:`rlflow.learner` (neither imports the other);
7. :mod:`rlflow.launcher` (start, supervise, watch);
8. :mod:`rlflow.console` (the ``rlflow`` command).
"""
