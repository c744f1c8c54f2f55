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

Retention: the newest ``CheckpointConfig.keep_last`` checkpoints, plus, when
``keep_best_metric`` is set, the best one by that metric (orbax ``LatestN`` or ``BestN``).

Restoring onto a different mesh (saved on fsdp=4, restored on fsdp=2 x tensor=2, or on a
different host count) goes through targets: pass a pytree of ``jax.ShapeDtypeStruct`` with
the new ``NamedSharding`` (:func:`abstract_target`) and orbax reads each shard straight into
its new place.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

from rlflow.config import CheckpointConfig

PyTree = Any
ITEMS = ("params", "opt_state", "value", "progress", "data", "meta")
ARRAY_ITEMS = ("params", "opt_state", "value")
FORMAT_VERSION = 1
_BYTES_KEY = "__bytes_base64__"


class CheckpointError(ValueError):
    """A checkpoint is missing, or does not fit what the caller restores it into."""


@dataclass
class LearnerCheckpoint:
    """What one learner checkpoint holds (see the module docstring for the on-disk items).

    Attributes:
      step: optimiser steps completed; the next step to run is ``step + 1``.
      params: policy parameters, a pytree of ``jax.Array`` (``nnx.State`` from
        ``nnx.split(model, nnx.Param)``).
      opt_state: optax state (``None``: not saved / not restored).
      value: PPO value head parameters (``nnx.State``, :mod:`rlflow.learner.value`), or
        ``None`` (group estimators: nothing saved).
      rngs: named PRNG keys, typed (``jax.random.key``) or raw ``uint32`` (``PRNGKey``);
        each must be fully replicated (the same on every host).
      data_state: prompt iterator state from grain's ``get_state()`` (dict or bytes), or None.
      policy_version: version of ``params``; the learner's step count unless set.
      extra: JSON-able loop counters (epoch, samples seen, dropped groups, ...).
      metadata: run metadata (:func:`run_metadata`).
    """

    step: int
    params: PyTree
    opt_state: PyTree = None
    value: PyTree = None
    rngs: Mapping[str, jax.Array] = field(default_factory=dict)
    data_state: Any = None
    policy_version: Optional[int] = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.step, (int, np.integer)) or self.step < 0:
            raise CheckpointError(f"LearnerCheckpoint.step: must be an int >= 0, got {self.step!r}")
        self.step = int(self.step)
        if self.policy_version is None:
            self.policy_version = self.step


def _absolute(path: str) -> str:
    """Local paths made absolute; ``gs://`` (any ``scheme://``) paths kept as given."""
    return path if "://" in path else os.path.abspath(path)


def checkpoint_dir(run_path: str) -> str:
    """The checkpoint folder of a run folder: ``<run_path>/checkpoints``.

    On a multi-host learner slice every host writes its own shards into the same
    folder, so ``run_path`` must be shared storage there (``gs://bucket/runs/x``).
    """
    return os.path.join(_absolute(run_path), "checkpoints")


def abstract_target(tree: PyTree, shardings: PyTree = None) -> PyTree:
    """Restore target for ``tree``: ``jax.ShapeDtypeStruct`` leaves with shardings.

    Args:
      tree: arrays or ``ShapeDtypeStruct`` (e.g. from ``jax.eval_shape`` of the init).
      shardings: pytree of ``jax.sharding.Sharding`` with ``tree``'s structure (e.g. from
        ``rlflow.mesh.param_shardings`` on the new mesh); None keeps each leaf's own sharding.
    """
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=getattr(x, "sharding", None)),
                            tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_metadata(cfg=None, mesh=None, **extra) -> dict:
    """Run metadata saved with every checkpoint (JSON types only).

    Args:
      cfg: the resolved ``ExperimentConfig`` (stored as ``dataclasses.asdict``, secrets
        redacted), or None.
      mesh: the learner's ``jax.sharding.Mesh`` (axis names and sizes are stored), or None.
      **extra: more JSON-able fields.
    """
    meta = {
        "format_version": FORMAT_VERSION,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "host": platform.node(),
        "process_count": jax.process_count(),
        "device_kind": jax.devices()[0].device_kind,
        "versions": {n: _dist_version(n) for n in
                     ("rlflow", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain")},
    }
    if cfg is not None:
        from rlflow.secrets import redact_config

        meta["config"] = redact_config(dataclasses.asdict(cfg))   # secrets stay out
    if mesh is not None:
        meta["mesh"] = {str(k): int(v) for k, v in mesh.shape.items()}
    meta.update(extra)
    return meta


# --- JSON encodings of RNG keys and iterator state -------------------------------------------

def _host_value(x, where: str) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            raise CheckpointError(f"{where}: must be fully replicated to be saved as JSON")
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def _encode_rngs(rngs: Mapping[str, jax.Array]) -> dict:
    out = {}
    for name, key in rngs.items():
        where = f"rngs[{name!r}]"
        if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            impl, data = str(jax.random.key_impl(key)), jax.random.key_data(key)
        else:
            impl, data = None, key
        data = _host_value(data, where)
        if data.dtype != np.uint32:
            raise CheckpointError(f"{where}: expected a typed PRNG key or uint32 key data, "
                                  f"got dtype {data.dtype}")
        out[name] = {"impl": impl, "shape": list(data.shape), "data": data.ravel().tolist()}
    return out


def _decode_rngs(encoded: Mapping[str, Any]) -> dict:
    out = {}
    for name, rec in encoded.items():
        data = np.asarray(rec["data"], dtype=np.uint32).reshape(rec["shape"])
        out[name] = (jax.random.wrap_key_data(data, impl=rec["impl"]) if rec["impl"]
                     else jax.numpy.asarray(data))
    return out


def _encode_data_state(state) -> dict:
    if state is None:
        return {"state": None}
    if isinstance(state, (bytes, bytearray)):
        return {"state": {_BYTES_KEY: base64.b64encode(bytes(state)).decode("ascii")}}
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"data_state: must be bytes or a JSON-able dict (grain "
                              f"get_state()), got {type(state).__name__}: {e}") from None
    return {"state": state}


def _decode_data_state(item: Mapping[str, Any]):
    state = item.get("state")
    if isinstance(state, dict) and set(state) == {_BYTES_KEY}:
        return base64.b64decode(state[_BYTES_KEY])
    return state


# --- the manager -------------------------------------------------------------------------------

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
        metric = cfg.keep_best_metric
        policies = [pp.LatestN(n=cfg.keep_last)]
        best_fn = None
        if metric:
            sign = 1.0 if cfg.keep_best_mode == "max" else -1.0

            def best_fn(metrics, _metric=metric, _sign=sign):
                value = float(metrics.get(_metric, math.nan))
                return _sign * value if math.isfinite(value) else -math.inf

            policies.append(pp.BestN(get_metric_fn=best_fn, n=1,
                                     keep_checkpoints_without_metrics=False))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=None if read_only else pp.AnyPreservationPolicy(policies),
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
                    "rngs": _encode_rngs(ckpt.rngs), "extra": dict(ckpt.extra)}
        args = {"params": ocp.args.StandardSave(ckpt.params),
                "progress": ocp.args.JsonSave(progress),
                "data": ocp.args.JsonSave(_encode_data_state(ckpt.data_state)),
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
        saved_tree = getattr(saved, "tree", saved)
        flat_saved = {_path_name(p): m for p, m in
                      jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
        flat_target = jax.tree_util.tree_flatten_with_path(target)[0]
        for path, leaf in flat_target:
            name = _path_name(path)
            meta = flat_saved.get(name)
            if meta is None:
                raise CheckpointError(f"{self.directory}/{step}/{item}: no saved array for "
                                      f"{name}; saved: {sorted(flat_saved)[:8]}...")
            if tuple(meta.shape) != tuple(leaf.shape):
                raise CheckpointError(f"{self.directory}/{step}/{item}/{name}: saved shape "
                                      f"{tuple(meta.shape)}, target expects {tuple(leaf.shape)}")
        if len(flat_target) != len(flat_saved):
            missing = sorted(set(flat_saved) - {_path_name(p) for p, _ in flat_target})
            raise CheckpointError(f"{self.directory}/{step}/{item}: the target lacks saved "
                                  f"arrays {missing[:8]}")

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
        """
        step = self._step_or_latest(step)
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
        params = got["params"]
        if params_target is None:
            params = jax.device_get(params)
        return LearnerCheckpoint(
            step=progress["step"], params=params,
            opt_state=got["opt_state"] if want_opt else None,
            value=got["value"] if want_value else None,
            rngs=_decode_rngs(progress.get("rngs", {})),
            data_state=_decode_data_state(got["data"]),
            policy_version=progress["policy_version"], extra=progress.get("extra", {}),
            metadata=got["meta"])

    def _array_restore_args(self, step: int, item: str, target: PyTree):
        if target is None:
            # No target: read onto the host CPU device (works whatever mesh saved it).
            saved = self._manager.item_metadata(step).get(item)
            cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
            target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu),
                                  getattr(saved, "tree", saved))
        else:
            self._check_target(step, item, target)
        return ocp.args.StandardRestore(abstract_target(target))


def _path_name(path) -> str:
    """A pytree key path as ``a/0/value``: the same string for a dict, a namedtuple or an
    ``nnx.State`` and for orbax's saved metadata tree of it."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


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
