"""Learner checkpoints: an orbax ``CheckpointManager`` over the state a run needs to resume.

One checkpoint (a folder ``<run>/checkpoints/<step>/``) holds these orbax items:

=============  ===================  ==========================================================
item           orbax handler        contents
=============  ===================  ==========================================================
``params``     ``StandardSave``     the policy parameters (``nnx.State`` or any pytree of arrays)
``opt_state``  ``StandardSave``     the optax state (its ``count`` is the optimiser step)
``value``      ``StandardSave``     the PPO value head (``learner.advantage="gae"``), only when
                                    there is one: kept out of ``params`` so that ``params``
                                    stays the policy alone (what ``rlflow export`` writes)
``progress``   ``JsonSave``         step, policy version, RNG keys (raw ``uint32`` key data and
                                    the key implementation), loop counters (``extra``)
``data``       ``JsonSave``         the prompt iterator state (grain ``get_state()``: a dict, or
                                    bytes stored base64)
``meta``       ``JsonSave``         run metadata: resolved config, library versions, mesh, time
``metrics``    (orbax's own)        the metrics given to :meth:`Checkpointer.save` (keep-best)
=============  ===================  ==========================================================

Saves are asynchronous (orbax copies device arrays to host, then writes in a background
thread) and atomic: orbax writes into ``<step>.orbax-checkpoint-tmp-*`` and renames it on
commit, so a process killed mid-save (SIGKILL, preemption) leaves the previous complete
checkpoint as :meth:`Checkpointer.latest_step`; the leftover temporary folder is removed
when the next :class:`Checkpointer` opens the folder.

Modules, one concept each:

* :mod:`~rlflow.checkpoint.state`: :class:`LearnerCheckpoint` (what one checkpoint holds in
  memory) and :class:`CheckpointError`.
* :mod:`~rlflow.checkpoint.manager`: :class:`Checkpointer` (save, restore, queries),
  :func:`checkpoint_dir`, :func:`resume`, :func:`restore_params`.
* :mod:`~rlflow.checkpoint.retention`: which checkpoints are kept: the newest
  ``CheckpointConfig.keep_last`` plus, when ``keep_best_metric`` is set, the best one by that
  metric (orbax ``LatestN`` or ``BestN``).
* :mod:`~rlflow.checkpoint.targets`: restore targets and re-sharding onto another mesh
  (:func:`abstract_target`), and the check that a target fits what was saved.
* :mod:`~rlflow.checkpoint.layer_layout`: checkpoints written with per-layer parameters
  (before the decoder stored its layers stacked) restored into the stacked layout.
* :mod:`~rlflow.checkpoint.json_items`: the JSON encodings of RNG keys and iterator state.
* :mod:`~rlflow.checkpoint.metadata`: :func:`run_metadata` (the ``meta`` item).
"""

from rlflow.checkpoint.manager import (ARRAY_ITEMS, ITEMS, Checkpointer, checkpoint_dir,
                                       restore_params, resume)
from rlflow.checkpoint.metadata import FORMAT_VERSION, run_metadata
from rlflow.checkpoint.state import (CheckpointError, DamagedCheckpointError,
                                     LearnerCheckpoint, PyTree)
from rlflow.checkpoint.targets import abstract_target

__all__ = ["ARRAY_ITEMS", "FORMAT_VERSION", "ITEMS", "CheckpointError", "Checkpointer",
           "DamagedCheckpointError",
           "LearnerCheckpoint", "PyTree", "abstract_target", "checkpoint_dir", "restore_params",
           "resume", "run_metadata"]
