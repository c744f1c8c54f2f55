"""Meshes, logical-axis rules and shardings: the one source of truth for layout.

Parameters carry *logical* axis names (``nnx.Param`` ``out_sharding`` metadata, set by
``rlflow.models.decoder``): ``("embed", "mlp")`` for an MLP kernel. ``LOGICAL_AXIS_RULES``
maps each logical name to mesh axes, MaxText-style: FSDP shards the ``embed`` dimension of
every weight, tensor parallelism shards heads / MLP width / vocab, expert parallelism splits
a mixture-of-experts layer's experts (logical ``expert``, the leading axis of the expert
weights ``[n_experts, ...]``) over ``expert``, the batch of activations is split over
``data`` x ``fsdp`` x ``expert`` (:data:`BATCH_AXES`: tokens are data-sharded over the expert
axis too, as in MaxText and GShard, and each MoE layer moves them to their experts' devices,
:mod:`rlflow.models.expert_parallel`) and the positions of the learner's activations
(``seq``) over ``sequence`` (context parallelism, :mod:`rlflow.models.context_parallel`;
parameters are replicated over it, as over ``data``; the parameters outside the experts are
replicated over ``expert`` too). A logical name with no rule is an error.

Axis order ``(data, fsdp, expert, sequence, tensor)``: the innermost axes, whose devices
are nearest each other, carry the most frequent collectives (tensor: all-reduces of the
projections; sequence: the all-gather of keys and values; expert: one gather and one
reduce-scatter of the tokens per MoE layer).

A dimension whose size is not divisible by its mesh axes (two KV heads on a tensor axis
of four) is replicated instead of sharded; that is the usual treatment of KV heads and
keeps every model loadable on every mesh.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "expert", "sequence", "tensor")

BATCH_AXES = ("data", "fsdp", "expert")
"""Mesh axes that split the batch's rows (and the sampler's slots)."""

LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("batch", BATCH_AXES),
    ("seq", "sequence"),       # the learner's [B, T, ...] activations (context parallelism)
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),      # a MoE layer's experts [n_experts, ...] (rlflow.models.moe)
    ("norm", None),
    ("lora_rank", None),      # LoRA adapter rank: small, never sharded
    ("layers", None),         # leading [L] axis of the stacked layers (models.layer_scan):
                              # each device holds every layer's slice of its shard
    # KV cache, per layer keys [B, K, D, S], values [B, K, S, D]
    ("cache_batch", BATCH_AXES),
    ("cache_seq", None),
    # paged KV cache, per layer pools [K, N, P, D] (rlflow.models.paged_kv_cache)
    ("cache_pages", None),
    ("page_tokens", None),
)

CACHE_AXES = ("cache_batch", "kv_heads", "cache_seq", "head_dim")
"""Logical axes of a layer's value cache ``[B, K, S, D]``."""
KEY_CACHE_AXES = ("cache_batch", "kv_heads", "head_dim", "cache_seq")
"""Logical axes of a layer's key cache ``[B, K, D, S]`` (head dim before positions)."""


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, fsdp, expert, sequence, tensor)`` mesh (:data:`AXES`) of
    ``mesh_cfg.num_devices`` devices.

    Args:
      mesh_cfg: :class:`rlflow.config.MeshConfig` (axis sizes).
      devices: the program's devices (default: ``jax.devices()``); their number must equal
        ``data * fsdp * expert * tensor * sequence``.

    Raises:
      ValueError: the device count does not match the mesh (names both).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = dict(data=mesh_cfg.data, fsdp=mesh_cfg.fsdp, tensor=mesh_cfg.tensor,
                 sequence=getattr(mesh_cfg, "sequence", 1), expert=getattr(mesh_cfg, "expert", 1))
    shape = tuple(sizes[a] for a in AXES)
    if len(devices) != math.prod(shape):
        raise ValueError(
            f"mesh {' x '.join(f'{a}={n}' for a, n in sizes.items() if a != 'expert' or n > 1)} "
            f"needs {math.prod(shape)} "
            f"devices, got {len(devices)}; pass `devices` or change the mesh config")
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)


def sequence_size(mesh: Mesh | None) -> int:
    """Devices along the ``sequence`` axis of ``mesh`` (1 without a mesh or the axis)."""
    return 1 if mesh is None else dict(mesh.shape).get("sequence", 1)


def expert_size(mesh: Mesh | None) -> int:
    """Devices along the ``expert`` axis of ``mesh`` (1 without a mesh or the axis)."""
    return 1 if mesh is None else dict(mesh.shape).get("expert", 1)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes of :data:`BATCH_AXES` that ``mesh`` has (older meshes lack ``expert``)."""
    return tuple(a for a in BATCH_AXES if a in mesh.axis_names)


def batch_shards(mesh: Mesh | None) -> int:
    """Parts the batch's rows are split into on ``mesh``: ``data x fsdp x expert`` (1
    without a mesh)."""
    return 1 if mesh is None else math.prod(dict(mesh.shape)[a] for a in batch_axes(mesh))


def _rule_table(rules) -> dict:
    table = {}
    for name, target in rules:
        table.setdefault(name, target)   # first rule wins
    return table


def logical_to_spec(logical_axes: tuple[str | None, ...], rules=LOGICAL_AXIS_RULES) -> P:
    """PartitionSpec of an array whose dimensions have these logical names.

    ``None`` stays unsharded. A mesh axis already used by an earlier dimension is not
    reused (the later dimension is replicated).

    Raises:
      ValueError: a logical name has no rule (names it and the known names).
    """
    table = _rule_table(rules)
    used: set[str] = set()
    out = []
    for name in logical_axes:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; known logical axes: "
                             f"{', '.join(sorted(table))}")
        target = table[name]
        targets = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        targets = tuple(t for t in targets if t not in used)
        used.update(targets)
        out.append(None if not targets else (targets[0] if len(targets) == 1 else targets))
    return P(*out)


def _fit(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """Replicate dimensions whose size the mesh axes do not divide."""
    fitted = []
    for size, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        n = math.prod(mesh.shape[a] for a in names) if names else 1
        fitted.append(axes if size % n == 0 else None)
    return P(*fitted)


def logical_sharding(mesh: Mesh, logical_axes, shape, rules=LOGICAL_AXIS_RULES) -> NamedSharding:
    """NamedSharding of one array of ``shape`` with the given logical axes."""
    return NamedSharding(mesh, _fit(logical_to_spec(tuple(logical_axes), rules), shape, mesh))


def _path_str(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_shardings(params: nnx.State, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
    """The NamedSharding of every parameter, as a tree shaped like ``params``.

    Args:
      params: ``nnx.State`` of ``nnx.Param`` (concrete or abstract, e.g. from
        ``nnx.eval_shape``), each with logical axes in its ``out_sharding`` metadata.
      mesh: the program's mesh.
      rules: logical-axis rules.

    Returns:
      The same tree with each Variable's value replaced by its ``NamedSharding`` (usable as
      ``jax.jit`` in/out shardings and by ``jax.device_put``).

    Raises:
      ValueError: a parameter has no logical axes, the wrong number of them, or a logical
        axis without a rule; the message names the parameter path.
    """
    def one(path, var):
        if not isinstance(var, nnx.Variable):
            raise ValueError(f"parameter {_path_str(path)}: expected an nnx.Variable, got "
                             f"{type(var).__name__}")
        shape = tuple(var.get_value().shape)
        axes = var.get_metadata().get("out_sharding")
        if axes is None:
            raise ValueError(f"parameter {_path_str(path)} {shape} has no logical axes "
                             "(out_sharding metadata)")
        if len(axes) != len(shape):
            raise ValueError(f"parameter {_path_str(path)}: logical axes {axes} do not match "
                             f"its shape {shape}")
        try:
            return var.replace(logical_sharding(mesh, axes, shape, rules))
        except ValueError as e:
            raise ValueError(f"parameter {_path_str(path)}: {e}") from None

    return jax.tree_util.tree_map_with_path(one, params,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_params(params: nnx.State, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> nnx.State:
    """``params`` placed on ``mesh`` in their :func:`param_shardings`."""
    return jax.device_put(params, param_shardings(params, mesh, rules))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of ``[batch, seq]`` arrays: batch over ``data`` x ``fsdp`` x ``expert``,
    positions over ``sequence`` (the learner's context parallelism; 1 elsewhere, or a mesh
    without it)."""
    seq = "sequence" if "sequence" in mesh.axis_names else None
    return NamedSharding(mesh, P(batch_axes(mesh), seq))


def activation_sharding(mesh: Mesh, shape: tuple[int, ...], folded: bool = False
                        ) -> NamedSharding:
    """Sharding of the learner's ``[batch, seq, ...]`` activations: logical axes
    ``("batch", "seq", None, ...)`` (batch over ``data`` x ``fsdp`` x ``expert``, positions
    over ``sequence``); a dimension the axes do not divide stays replicated. ``folded``: the
    ``[sequence x batch, seq / sequence, ...]`` view of context parallelism
    (:func:`rlflow.models.context_parallel.fold`), its leading axis over ``sequence`` x
    ``data`` x ``fsdp`` x ``expert``."""
    if folded:
        spec = P(("sequence",) + batch_axes(mesh), *((None,) * (len(shape) - 1)))
        return NamedSharding(mesh, _fit(spec, shape, mesh))
    return logical_sharding(mesh, ("batch", "seq") + (None,) * (len(shape) - 2), shape)


def cache_sharding(mesh: Mesh, cache, rules=LOGICAL_AXIS_RULES):
    """Shardings of a :class:`rlflow.models.kv_cache.KVCache` (same NamedTuple shape; its
    arrays, or anything with a ``.shape``: keys per :data:`KEY_CACHE_AXES`, values per
    :data:`CACHE_AXES`; None for a linear-attention layer). ``cache.linear`` (gated DeltaNet
    states, :class:`rlflow.models.gdn_layer.GDNState`): slots over ``cache_batch``, the rest
    replicated (a state per slot is small and does not grow with the sequence)."""
    def each(axes, arrays):
        return tuple(None if a is None else logical_sharding(mesh, axes, a.shape, rules)
                     for a in arrays)
    mask = logical_sharding(mesh, ("cache_batch", "cache_seq"), cache.mask.shape, rules)
    linear = jax.tree.map(lambda a: logical_sharding(
        mesh, ("cache_batch",) + (None,) * (len(a.shape) - 1), a.shape, rules),
        tuple(getattr(cache, "linear", ())))
    return type(cache)(k=each(KEY_CACHE_AXES, cache.k), v=each(CACHE_AXES, cache.v),
                       mask=mask, linear=linear)


PAGE_POOL_AXES = ("kv_heads", "cache_pages", "page_tokens", "head_dim")
"""Logical axes of a layer's paged key or value pool ``[K, N, P, D]``."""


def paged_cache_sharding(mesh: Mesh, cache, rules=LOGICAL_AXIS_RULES):
    """Shardings of a :class:`rlflow.models.paged_kv_cache.PagedKVCache` (its arrays, or
    anything with a ``.shape``): pools per :data:`PAGE_POOL_AXES` (KV heads over ``tensor``;
    every slot's pages are reachable from every device of the slot axis; None for a
    linear-attention layer), page table and mask per slot (``cache_batch``), the
    sliding layers' rings and the linear-attention states as :func:`cache_sharding`'s."""
    pool = lambda a: logical_sharding(mesh, PAGE_POOL_AXES, a.shape, rules)  # noqa: E731
    linear = jax.tree.map(lambda a: logical_sharding(
        mesh, ("cache_batch",) + (None,) * (len(a.shape) - 1), a.shape, rules),
        tuple(cache.linear))
    def layer(i, a, ring_axes):      # a sliding layer's ring per slot: as a contiguous cache
        if a is None:
            return None
        return pool(a) if cache.is_pool(i) else logical_sharding(mesh, ring_axes, a.shape, rules)
    return cache.replace(
        k=tuple(layer(i, a, KEY_CACHE_AXES) for i, a in enumerate(cache.k)),
        v=tuple(layer(i, a, CACHE_AXES) for i, a in enumerate(cache.v)),
        page_table=logical_sharding(mesh, ("cache_batch", None), cache.page_table.shape, rules),
        mask=logical_sharding(mesh, ("cache_batch", "cache_seq"), cache.mask.shape, rules),
        linear=linear)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
