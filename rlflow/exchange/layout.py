"""Weight layouts as plain data: what a publisher announces and a subscriber rebuilds.

A published pytree (e.g. the learner's ``nnx.State`` of params) is described leaf by leaf,
in ``jax.tree_util`` flatten order, as JSON-able dicts::

    {"path": "['layers']['attn']['q_kernel'].value", "shape": [4, 64, 4, 16],
     "dtype": "float32", "mesh": 0, "spec": [null, "fsdp", "tensor", null]}

with a shared list of meshes ``{"shape": [2, 2], "axes": ["fsdp", "tensor"],
"devices": [0, 1, 2, 3]}`` whose ``devices`` are positions in the publisher's
``jax.local_devices()``. A ``jax.experimental.transfer`` pull must ask for exactly the
source's shard layout, so the subscriber rebuilds the same meshes from *its own* local devices
at the same positions (:func:`pull_avals`) and re-lays the pulled arrays onto its own
shardings afterwards (:func:`relayout`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding


class LayoutError(ValueError):
    """A pytree or layout that cannot be published, pulled or matched (names the leaf)."""


def _is_target_leaf(x) -> bool:
    return isinstance(x, (jax.sharding.Sharding, jax.ShapeDtypeStruct))


def flatten(tree, *, targets: bool = False) -> tuple[list[str], list[Any], Any]:
    """``(paths, leaves, treedef)`` with ``jax.tree_util.keystr`` paths.

    With ``targets=True`` a ``Sharding`` or ``ShapeDtypeStruct`` counts as a leaf.
    """
    is_leaf = _is_target_leaf if targets else None
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [jax.tree_util.keystr(p) for p, _ in pairs], [x for _, x in pairs], treedef


def _spec_entry(e):
    if e is None or isinstance(e, str):
        return e
    if isinstance(e, tuple) and all(isinstance(a, str) for a in e):
        return list(e)
    raise LayoutError(f"partition spec entry {e!r} cannot be published")


def describe(paths: Sequence[str], leaves: Sequence[jax.Array]) -> dict:
    """JSON-able layout ``{"meshes": [...], "leaves": [...]}`` of arrays on this process.

    Raises:
      LayoutError: a leaf is not a ``jax.Array``, spans other processes, or has a sharding
        other than ``NamedSharding`` / ``SingleDeviceSharding``.
    """
    index = {d: i for i, d in enumerate(jax.local_devices())}
    meshes: list[dict] = []
    mesh_ids: dict[tuple, int] = {}
    out = []
    for path, x in zip(paths, leaves):
        if not isinstance(x, jax.Array):
            raise LayoutError(f"leaf {path}: expected a jax.Array, got {type(x).__name__}")
        if not x.is_fully_addressable:
            raise LayoutError(f"leaf {path}: spans several processes; publish from one process")
        s = x.sharding
        if isinstance(s, NamedSharding):
            mesh = {"shape": list(s.mesh.devices.shape), "axes": list(s.mesh.axis_names),
                    "devices": [index[d] for d in s.mesh.devices.flat]}
            spec = [_spec_entry(e) for e in s.spec]
        elif isinstance(s, SingleDeviceSharding):
            mesh = {"shape": [1], "axes": ["_device"], "devices": [index[next(iter(s.device_set))]]}
            spec = []
        else:
            raise LayoutError(f"leaf {path}: sharding {type(s).__name__} cannot be published; use "
                              "NamedSharding")
        key = (tuple(mesh["shape"]), tuple(mesh["axes"]), tuple(mesh["devices"]))
        if key not in mesh_ids:
            mesh_ids[key] = len(meshes)
            meshes.append(mesh)
        out.append({"path": path, "shape": list(x.shape), "dtype": str(x.dtype),
                    "mesh": mesh_ids[key], "spec": spec})
    return {"meshes": meshes, "leaves": out}


def pull_avals(layout: dict, devices: Sequence[jax.Device] | None = None) -> list:
    """``ShapeDtypeStruct`` per leaf with the publisher's shard layout on *these* devices.

    Raises:
      LayoutError: the layout needs a device position this process does not have.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    meshes = []
    for m in layout["meshes"]:
        if max(m["devices"]) >= len(devices):
            raise LayoutError(
                f"the published layout uses device positions up to {max(m['devices'])} (mesh "
                f"{dict(zip(m['axes'], m['shape']))}) but this process has {len(devices)} "
                "devices: give the subscriber at least as many devices or publish with "
                "layout='single_device' (runtime.transfer_layout=\"single_device\")")
        devs = np.array([devices[i] for i in m["devices"]], dtype=object).reshape(m["shape"])
        meshes.append(Mesh(devs, tuple(m["axes"])))
    out = []
    for leaf in layout["leaves"]:
        spec = PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in leaf["spec"]])
        out.append(jax.ShapeDtypeStruct(tuple(leaf["shape"]), jnp.dtype(leaf["dtype"]),
                                        sharding=NamedSharding(meshes[leaf["mesh"]], spec)))
    return out


def target_shardings(target, layout_leaves: Sequence[dict]) -> tuple[list, Any]:
    """Shardings of ``target``'s leaves, checked against the published leaves.

    Args:
      target: pytree whose leaves are arrays, ``ShapeDtypeStruct`` with a sharding, or
        ``Sharding`` objects, with the publisher's structure (same paths, same order).
      layout_leaves: the ``"leaves"`` of a layout (or dicts with path, shape, dtype).

    Returns:
      ``(list of shardings, target treedef)``.

    Raises:
      LayoutError: naming the first leaf whose path, shape or dtype differs, or a count
        mismatch.
    """
    paths, leaves, treedef = flatten(target, targets=True)
    if len(paths) != len(layout_leaves):
        raise LayoutError(f"target has {len(paths)} leaves, the published weights "
                          f"{len(layout_leaves)}")
    shardings = []
    for path, x, want in zip(paths, leaves, layout_leaves):
        if path != want["path"]:
            raise LayoutError(f"target leaf {path} where the published weights have "
                              f"{want['path']}")
        if not isinstance(x, jax.sharding.Sharding):
            if list(x.shape) != list(want["shape"]) or str(x.dtype) != want["dtype"]:
                raise LayoutError(f"leaf {path}: target {x.dtype}{list(x.shape)}, published "
                                  f"{want['dtype']}{want['shape']}")
            x = x.sharding
        if x is None:
            raise LayoutError(f"leaf {path}: the target gives no sharding")
        shardings.append(x)
    return shardings, treedef


def relayout(arrays: Sequence[jax.Array], target, layout_leaves: Sequence[dict]):
    """Place pulled arrays onto ``target``'s shardings (``jax.device_put``) in its structure;
    with ``target=None`` return ``{path: array}`` as pulled."""
    if target is None:
        return {leaf["path"]: a for leaf, a in zip(layout_leaves, arrays)}
    shardings, treedef = target_shardings(target, layout_leaves)
    return jax.tree_util.tree_unflatten(treedef, jax.device_put(list(arrays), shardings))
