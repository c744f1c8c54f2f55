"""Restore targets: the shapes, dtypes and shardings orbax reads each saved array into.

Restoring onto a different mesh (saved on fsdp=4, restored on fsdp=2 x tensor=2, or on a
different host count) goes through a pytree of ``jax.ShapeDtypeStruct`` with the new
``NamedSharding`` (:func:`abstract_target`): orbax reads each shard straight into its new
place. :func:`check_target` compares a target with what was saved first, so a mismatch
names the array instead of failing deep inside orbax.
"""

from __future__ import annotations

import jax

from rlflow.checkpoint.state import CheckpointError, PyTree


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


def host_target(saved_tree: PyTree) -> PyTree:
    """Target that reads every saved array onto the host CPU device (whatever mesh saved it).

    Args:
      saved_tree: orbax's saved metadata tree of one item (leaves with ``shape``, ``dtype``).
    """
    cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu),
                        saved_tree)


def path_name(path) -> str:
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


def check_target(where: str, saved_tree: PyTree, target: PyTree) -> None:
    """Check that ``target`` has exactly the saved arrays, each with its saved shape.

    Args:
      where: the item's location for errors (``<folder>/<step>/<item>``).
      saved_tree: orbax's saved metadata tree of the item (leaves with ``shape``).
      target: the restore target (arrays or ``jax.ShapeDtypeStruct``).

    Raises:
      CheckpointError: the target has an array that was not saved, one of another
        shape, or lacks saved arrays (names the array(s) by :func:`path_name`).
    """
    flat_saved = {path_name(p): m for p, m in
                  jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
    flat_target = jax.tree_util.tree_flatten_with_path(target)[0]
    for path, leaf in flat_target:
        name = path_name(path)
        meta = flat_saved.get(name)
        if meta is None:
            raise CheckpointError(f"{where}: no saved array for "
                                  f"{name}; saved: {sorted(flat_saved)[:8]}...")
        if tuple(meta.shape) != tuple(leaf.shape):
            raise CheckpointError(f"{where}/{name}: saved shape "
                                  f"{tuple(meta.shape)}, target expects {tuple(leaf.shape)}")
    if len(flat_target) != len(flat_saved):
        missing = sorted(set(flat_saved) - {path_name(p) for p, _ in flat_target})
        raise CheckpointError(f"{where}: the target lacks saved arrays {missing[:8]}")
