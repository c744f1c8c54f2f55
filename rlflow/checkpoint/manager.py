"""The learner's checkpoint manager: :class:`Checkpointer`, a thin shell over orbax's
``CheckpointManager`` with one orbax item per part of :class:`LearnerCheckpoint` (the
item table is in :mod:`rlflow.checkpoint`), and the two entry points built on it:
:func:`resume` (the automatic resume) and :func:`restore_params` (``rlflow export``).
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from rlflow.checkpoint import layer_layout
from rlflow.checkpoint.json_items import (decode_data_state, decode_rngs, encode_data_state,
                                          encode_rngs)
from rlflow.checkpoint.metadata import run_metadata
from rlflow.checkpoint.retention import preservation
from rlflow.checkpoint.state import (CheckpointError, DamagedCheckpointError,
                                     LearnerCheckpoint, PyTree)
from rlflow.checkpoint.targets import abstract_target, check_target, host_target
from rlflow.config import CheckpointConfig

ITEMS = ("params", "opt_state", "value", "progress", "data", "meta")
ARRAY_ITEMS = ("params", "opt_state", "value")


def _absolute(path: str) -> str:
    """Local paths made absolute; ``gs://`` (any ``scheme://``) paths kept as given."""
    return path if "://" in path else os.path.abspath(path)


def _damaged(directory: str, step: int, error: BaseException,
             earlier: list[int]) -> DamagedCheckpointError:
    """The error of a checkpoint whose files cannot be read: the innermost error of the
    chain (tensorstore's names the file and byte range; the outer ones repeat a spec of
    hundreds of lines), its first line cut at 300 characters, and the way out of a training
    run: resume from the newest of the ``earlier`` steps, or, with none, start over."""
    inner = error
    while (inner.__cause__ or inner.__context__) is not None:
        inner = inner.__cause__ or inner.__context__
    line = (str(inner).strip().splitlines() or [""])[0].split(" [tensorstore_spec=")[0][:300]
    reason = f"{type(inner).__name__}: {line}"
    base = directory.rstrip("/")
    aside = f"mv {base}/{step} {base}.damaged-{step}"
    if earlier:
        way = (f"to resume from step {earlier[-1]}, the checkpoint before it, move this one "
               f"aside ({aside}) and rerun")
    else:
        way = (f"there is no earlier checkpoint in {base}, so a rerun after moving it aside "
               f"({aside}) starts over from step 0 (its records after step 0 are removed); or "
               f"start over in a clean folder with --checkpoint.resume never "
               f"--checkpoint.overwrite true")
    return DamagedCheckpointError(folder=f"{base}/{step}", step=step, reason=reason,
                                  earlier=earlier, way=way)


def checkpoint_dir(run_path: str) -> str:
    """The checkpoint folder of a run folder: ``<run_path>/checkpoints``.

    On a multi-host learner slice every host writes its own shards into the same
    folder, so ``run_path`` must be shared storage there (``gs://bucket/runs/x``).
    """
    return os.path.join(_absolute(run_path), "checkpoints")


class Checkpointer:
    """Saves and restores :class:`LearnerCheckpoint` under one folder (a thin orbax shell).

    Every host of the learner program must call :meth:`save` and :meth:`restore` (orbax
    synchronises them); JSON items are written by the primary host only.

    Args:
      directory: the checkpoint folder (created when missing); see :func:`checkpoint_dir`.
      cfg: ``CheckpointConfig`` (``every_steps``, ``keep_last``, ``keep_best_metric``,
        ``keep_best_mode``).
      async_save: write in a background thread (``False``: :meth:`save` blocks until done).
      read_only: open for restore only (export, evaluation): never writes or deletes.
    """

    def __init__(self, directory: str, cfg: CheckpointConfig = CheckpointConfig(), *,
                 async_save: bool = True, read_only: bool = False):
        self.directory = _absolute(directory)
        self.cfg = cfg
        policy, best_fn = preservation(cfg)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=None if read_only else policy,
            best_fn=best_fn, best_mode="max",
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        if read_only and not epath.Path(self.directory).is_dir():
            raise CheckpointError(f"no checkpoint folder at {self.directory}")
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for name in ITEMS:
            arrays = name in ARRAY_ITEMS
            handler = ocp.StandardCheckpointHandler() if arrays else ocp.JsonCheckpointHandler()
            registry.add(name, ocp.args.StandardSave if arrays else ocp.args.JsonSave, handler)
            registry.add(name, ocp.args.StandardRestore if arrays else ocp.args.JsonRestore,
                         handler)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              handler_registry=registry)

    # -- queries --
    def all_steps(self) -> list[int]:
        """Steps of the complete (committed) checkpoints, increasing."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> Optional[int]:
        """Newest complete checkpoint's step, or None when there is none."""
        return self._manager.latest_step()

    def best_step(self) -> Optional[int]:
        """Step with the best ``keep_best_metric`` (None when off or no metrics saved)."""
        return self._manager.best_step() if self.cfg.keep_best_metric else None

    def metrics(self, step: int) -> Optional[dict]:
        """Metrics saved with ``step`` (only kept when ``keep_best_metric`` is set)."""
        return self._manager.metrics(step)

    def run_metadata(self, step: Optional[int] = None) -> dict:
        """The ``meta`` item of checkpoint ``step`` (default: the latest), reading no array.

        Raises:
          CheckpointError: no such step (lists the available ones).
        """
        step = self._step_or_latest(step)
        got = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(got["meta"])

    def should_save(self, step: int) -> bool:
        """True on every ``every_steps``-th step (never when ``every_steps`` is 0)."""
        return self.cfg.every_steps > 0 and step > 0 and step % self.cfg.every_steps == 0

    # -- save --
    def save(self, ckpt: LearnerCheckpoint, *, metrics: Optional[Mapping[str, float]] = None,
             force: bool = False) -> bool:
        """Start saving ``ckpt`` if :meth:`should_save` (or ``force``); returns whether it did.

        Returns once device arrays are copied to host; the write continues in the
        background (a previous save still in flight is waited for first).

        Raises:
          CheckpointError: ``metrics`` lacks ``keep_best_metric``; an RNG key is not
            replicated or not uint32; ``data_state`` is neither bytes nor JSON-able.
        """
        if not (force or self.should_save(ckpt.step)):
            return False
        if ckpt.step in self._manager.all_steps():
            return False
        metric = self.cfg.keep_best_metric
        if metrics is not None:
            metrics = {k: float(v) for k, v in metrics.items()}
            if metric and metric not in metrics:
                raise CheckpointError(f"checkpoint.keep_best_metric={metric!r} is not among the "
                                      f"metrics given for step {ckpt.step}: {sorted(metrics)}")
        progress = {"step": ckpt.step, "policy_version": int(ckpt.policy_version),
                    "rngs": encode_rngs(ckpt.rngs), "extra": dict(ckpt.extra)}
        args = {"params": ocp.args.StandardSave(ckpt.params),
                "progress": ocp.args.JsonSave(progress),
                "data": ocp.args.JsonSave(encode_data_state(ckpt.data_state)),
                "meta": ocp.args.JsonSave(dict(ckpt.metadata) or run_metadata())}
        if ckpt.opt_state is not None:
            args["opt_state"] = ocp.args.StandardSave(ckpt.opt_state)
        if ckpt.value is not None:
            args["value"] = ocp.args.StandardSave(ckpt.value)
        return self._manager.save(ckpt.step, args=ocp.args.Composite(**args),
                                  metrics=metrics if metric else None, force=True)

    def save_final(self, ckpt: LearnerCheckpoint, *,
                   metrics: Optional[Mapping[str, float]] = None) -> bool:
        """The save at exit: saves ``ckpt`` unless its step is already saved, then waits."""
        saved = self.save(ckpt, metrics=metrics, force=True)
        self.wait()
        return saved

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raises its error."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the save in flight, then release orbax's threads."""
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- restore --
    def _step_or_latest(self, step: Optional[int]) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"no complete checkpoint in {self.directory}")
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; "
                                  f"available steps: {steps}")
        return step

    def _check_target(self, step: int, item: str, target: PyTree) -> None:
        saved = self._manager.item_metadata(step).get(item)
        if saved is None:
            raise CheckpointError(f"{self.directory}/{step}: has no {item!r} item")
        check_target(f"{self.directory}/{step}/{item}", getattr(saved, "tree", saved), target)

    def restore(self, step: Optional[int] = None, *, params_target: PyTree = None,
                opt_state_target: PyTree = None, restore_opt_state: bool = True,
                value_target: PyTree = None, restore_value: bool = True
                ) -> LearnerCheckpoint:
        """Restore checkpoint ``step`` (default: the latest).

        Args:
          params_target / opt_state_target: pytrees of ``jax.ShapeDtypeStruct`` (with the
            shardings to restore onto, see :func:`abstract_target`) or of arrays (their
            shardings are used). None reads ``params`` as host ``numpy`` arrays in a nested
            dict (what export needs) and ``opt_state`` onto the host CPU device.
          restore_opt_state: False skips the optimiser state (export, evaluation).
          value_target: target of the PPO value head, as ``params_target``; given, the
            checkpoint must hold a ``value`` item.
          restore_value: False skips the value head. A checkpoint without one restores
            ``value=None`` when no ``value_target`` is given.

        Raises:
          CheckpointError: no such step, a target's tree or shapes differ from what
            was saved (names the array), or ``value_target`` is given but the checkpoint
            has no value head (saved by a run without ``learner.advantage="gae"``).
          DamagedCheckpointError: its files cannot be read (names the step folder, the
            innermost error, and how to resume from the checkpoint before it).
        """
        step = self._step_or_latest(step)
        try:
            return self._restore(step, params_target, opt_state_target, restore_opt_state,
                                 value_target, restore_value)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - tensorstore / orbax raise many kinds
            earlier = [s for s in self.all_steps() if s < step]
            raise _damaged(self.directory, step, e, earlier) from e

    def _restore(self, step, params_target, opt_state_target, restore_opt_state, value_target,
                 restore_value) -> LearnerCheckpoint:
        saved_items = self._manager.item_metadata(step)
        want_opt = restore_opt_state and saved_items.get("opt_state") is not None
        args = {"params": self._array_restore_args(step, "params", params_target),
                "progress": ocp.args.JsonRestore(), "data": ocp.args.JsonRestore(),
                "meta": ocp.args.JsonRestore()}
        if want_opt:
            args["opt_state"] = self._array_restore_args(step, "opt_state", opt_state_target)
        want_value = restore_value and saved_items.get("value") is not None
        if restore_value and value_target is not None and not want_value:
            raise CheckpointError(
                f"{self.directory}/{step}: has no 'value' item, but a PPO value head is "
                f"restored (learner.advantage='gae'); this checkpoint was saved without one")
        if want_value:
            args["value"] = self._array_restore_args(step, "value", value_target)
        got = self._manager.restore(step, args=ocp.args.Composite(**args))
        progress = got["progress"]
        params = self._stacked(step, "params", got["params"], params_target)
        if params_target is None:
            params = jax.device_get(params)
        return LearnerCheckpoint(
            step=progress["step"], params=params,
            opt_state=(self._stacked(step, "opt_state", got["opt_state"], opt_state_target)
                       if want_opt else None),
            value=(self._stacked(step, "value", got["value"], value_target)
                   if want_value else None),
            rngs=decode_rngs(progress.get("rngs", {})),
            data_state=decode_data_state(got["data"]),
            policy_version=progress["policy_version"], extra=progress.get("extra", {}),
            metadata=got["meta"])

    def _saved_tree(self, step: int, item: str) -> PyTree:
        saved = self._manager.item_metadata(step).get(item)
        return getattr(saved, "tree", saved)

    def _converts(self, step: int, item: str, target: PyTree) -> bool:
        """Whether ``item`` was saved per layer (before the layers were stored stacked) and
        is restored into the stacked layout (:mod:`rlflow.checkpoint.layer_layout`)."""
        saved = self._saved_tree(step, item)
        return (saved is not None and layer_layout.is_per_layer(saved)
                and (target is None or not layer_layout.is_per_layer(target)))

    def _array_restore_args(self, step: int, item: str, target: PyTree):
        if target is None:
            # No target: read onto the host CPU device (works whatever mesh saved it).
            target = host_target(self._saved_tree(step, item))
        elif self._converts(step, item, target):
            target = layer_layout.per_layer_target(f"{self.directory}/{step}/{item}",
                                                   self._saved_tree(step, item),
                                                   abstract_target(target))
        else:
            self._check_target(step, item, target)
        return ocp.args.StandardRestore(abstract_target(target))

    def _stacked(self, step: int, item: str, restored: PyTree, target: PyTree) -> PyTree:
        """``restored`` in the stacked layout: as it is, or (a per-layer checkpoint) its
        layers stacked onto ``target``'s shardings, or on the host without a target."""
        if not self._converts(step, item, target):
            return restored
        if target is None:
            return layer_layout.stack_host_tree(jax.device_get(restored))
        return layer_layout.stack_restored(restored, abstract_target(target))


def resume(checkpointer: Checkpointer, *, params_target: PyTree,
           opt_state_target: PyTree = None, value_target: PyTree = None
           ) -> Optional[LearnerCheckpoint]:
    """The automatic resume: the latest checkpoint, or None to start fresh.

    Returns None when ``checkpoint.resume == "never"`` or the folder has no complete
    checkpoint; otherwise the restored :class:`LearnerCheckpoint` whose ``step`` is the
    last completed step (the loop continues at ``step + 1``, with ``data_state`` given
    to the iterator's ``set_state`` and ``rngs`` replacing the fresh keys).
    ``value_target`` (PPO): the value head's target; the checkpoint must hold one.

    Raises: CheckpointError as :meth:`Checkpointer.restore`.
    """
    if checkpointer.cfg.resume == "never" or checkpointer.latest_step() is None:
        return None
    return checkpointer.restore(params_target=params_target, opt_state_target=opt_state_target,
                                value_target=value_target)


def restore_params(directory: str, step: Optional[int] = None, *, target: PyTree = None
                   ) -> tuple[int, PyTree, dict]:
    """Read only the parameters of a checkpoint folder (for ``rlflow export``).

    Returns:
      ``(step, params, metadata)``: params as ``target``'s structure and shardings, or as
      host numpy arrays in a nested dict when ``target`` is None.

    Raises:
      CheckpointError: the folder or step does not exist, or ``target`` does not fit.
    """
    ckpt = Checkpointer(directory, read_only=True)
    try:
        restored = ckpt.restore(step, params_target=target, restore_opt_state=False,
                                restore_value=False)
    finally:
        ckpt.close()
    return restored.step, restored.params, dict(restored.metadata)
