"""Checkpoints written before the decoder stored its layers stacked, restored into the
stacked layout.

Before, the decoder held its blocks as a list, and a checkpoint saved each layer's arrays
under its own index: ``layers/0/attn/q_kernel/value`` ``[E, H, D]``, ``layers/1/...``, in the
parameters and again in every optimiser moment (``0/mu/layers/0/...``). Now one array holds
every layer (``layers/attn/q_kernel/value`` ``[L, E, H, D]``,
:mod:`rlflow.models.layer_scan`). Restoring such a checkpoint into the stacked model reads
each layer's array onto the stacked array's sharding without its leading axis
(:func:`per_layer_target`) and stacks them in order (:func:`stack_restored`); read without a
target (host numpy), the per-layer dicts are stacked on the host (:func:`stack_host_tree`).
Values are unchanged: the same bits, in the new place.

Which arrays are per layer is read from the path names (:func:`rlflow.checkpoint.targets.path_name`):
a ``layers`` key followed by a layer number.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rlflow.checkpoint.state import CheckpointError, PyTree
from rlflow.checkpoint.targets import path_name
from rlflow.models.layer_scan import LAYER_AXIS, stack_trees

def split_name(name: str) -> tuple[str, int | None]:
    """``"0/mu/layers/3/attn/q_kernel/value"`` -> ``("0/mu/layers/attn/q_kernel/value", 3)``;
    a name without a layer number -> ``(name, None)``."""
    parts = name.split("/")
    for j in range(len(parts) - 1):
        if parts[j] == LAYER_AXIS and parts[j + 1].isdigit():
            return "/".join(parts[:j + 1] + parts[j + 2:]), int(parts[j + 1])
    return name, None


def _names(tree) -> list[tuple[str, object]]:
    return [(path_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def is_per_layer(tree: PyTree) -> bool:
    """Whether a tree (saved metadata or a target) names arrays per layer (``layers/<i>/``)."""
    return any(split_name(name)[1] is not None for name, _ in _names(tree))


def _layer_sharding(sharding):
    """The sharding of one layer of a stacked array: its spec without the leading (never
    sharded) layer axis."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]),
                             memory_kind=sharding.memory_kind)
    return sharding                     # single device / host: the same place


def per_layer_target(where: str, saved_tree: PyTree, target: PyTree) -> PyTree:
    """The restore target of a per-layer checkpoint item, in the saved structure.

    Args:
      where: the item's location for errors (``<folder>/<step>/<item>``).
      saved_tree: orbax's saved metadata tree of the item (per-layer names).
      target: the stacked restore target (arrays or ``jax.ShapeDtypeStruct`` with
        shardings).

    Returns:
      ``saved_tree``'s structure with ``jax.ShapeDtypeStruct`` leaves: a per-layer array gets
      its stacked target's dtype and sharding without the leading axis; any other array its
      target's own.

    Raises:
      CheckpointError: a saved array has no stacked counterpart in the target, another
        shape than one layer of it, a layer number past its ``L``, or a layer is missing
        (names the array and says to restore with the rlflow that wrote it or to convert).
    """
    flat_target = dict(_names(target))
    seen: dict[str, set] = {}
    advice = ("the checkpoint was written with per-layer parameters (before the layers were "
              "stored stacked) and does not match this model")

    def one(path, meta):
        name = path_name(path)
        stacked, layer = split_name(name)
        leaf = flat_target.get(stacked)
        if leaf is None:
            raise CheckpointError(f"{where}/{name}: {advice}: the model has no {stacked}")
        sharding = getattr(leaf, "sharding", None)
        if layer is None:
            if tuple(meta.shape) != tuple(leaf.shape):
                raise CheckpointError(f"{where}/{name}: saved shape {tuple(meta.shape)}, "
                                      f"target expects {tuple(leaf.shape)}")
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        if tuple(meta.shape) != tuple(leaf.shape[1:]) or layer >= leaf.shape[0]:
            raise CheckpointError(
                f"{where}/{name}: {advice}: saved layer {layer} of shape {tuple(meta.shape)}, "
                f"the model's {stacked} is {tuple(leaf.shape)} ([layers, ...])")
        seen.setdefault(stacked, set()).add(layer)
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype,
                                    sharding=None if sharding is None else _layer_sharding(sharding))

    out = jax.tree_util.tree_map_with_path(one, saved_tree)
    saved = {split_name(n)[0] for n, _ in _names(saved_tree)}
    for name, leaf in flat_target.items():
        if name not in saved:
            raise CheckpointError(f"{where}: no saved array for {name} ({advice})")
        if name in seen and seen[name] != set(range(leaf.shape[0])):
            missing = sorted(set(range(leaf.shape[0])) - seen[name])
            raise CheckpointError(f"{where}/{name}: {advice}: layers {missing} are not saved")
    return out


def stack_restored(restored: PyTree, target: PyTree) -> PyTree:
    """The arrays restored with :func:`per_layer_target` in ``target``'s structure: each
    stacked array from its layers ``0 .. L-1`` in order, placed on ``target``'s sharding."""
    by_name = dict(_names(restored))
    paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    values = []
    for path, leaf in paths:
        name = path_name(path)
        if name in by_name:
            values.append(by_name[name])
            continue
        layers = [by_name[_layer_name(name, i)] for i in range(leaf.shape[0])]
        sharding = getattr(leaf, "sharding", None)
        stack = jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)
        values.append(stack(*layers))
    return jax.tree_util.tree_unflatten(treedef, values)


def _layer_name(stacked: str, layer: int) -> str:
    parts = stacked.split("/")
    at = parts.index(LAYER_AXIS)
    return "/".join(parts[:at + 1] + [str(layer)] + parts[at + 1:])


def stack_host_tree(tree: PyTree) -> PyTree:
    """A per-layer item read without a target (nested dicts of host arrays) in the stacked
    layout: every ``layers`` dict keyed by layer numbers ``"0" .. "L-1"`` becomes one dict
    of ``[L, ...]`` numpy arrays (:func:`rlflow.models.layer_scan.stack_trees`)."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            if (key == LAYER_AXIS and isinstance(value, dict) and value
                    and all(str(k).isdigit() for k in value)):
                keys = sorted(value, key=int)
                if [int(k) for k in keys] != list(range(len(keys))):
                    raise CheckpointError(f"per-layer arrays of layers {keys}: expected "
                                          f"layers 0 .. {len(keys) - 1}")
                out[key] = stack_trees([jax.tree.map(np.asarray, stack_host_tree(value[k]))
                                        for k in keys])
            else:
                out[key] = stack_host_tree(value)
        return out
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(stack_host_tree(v) for v in tree)
    return tree
