"""Expert parallelism: a mixture-of-experts layer's experts split over the ``expert`` mesh axis.

Layout (:mod:`rlflow.mesh`): the expert weights ``[X, E, F]`` / ``[X, F, E]`` (logical axes
``("expert", "embed", "mlp")`` / ``("expert", "mlp", "embed")``) are split ``X / ep`` experts
a device over ``expert``, their ``E`` over ``fsdp`` and ``F`` over ``tensor``; the tokens are
split over ``data x fsdp x expert`` (and ``sequence``), as every other activation
(:data:`rlflow.mesh.BATCH_AXES`). Routing (router logits, top-k, gates) is token-wise and runs
where the tokens are; only the experts' SwiGLU needs the tokens on their experts' devices.

Dispatch and combine (:func:`expert_ffn`, under ``jax.shard_map`` over every mesh axis):

1. all-gather over ``expert`` the ``n`` local tokens, their top-k expert ids and gates:
   every device of an expert group sees the group's ``ep x n`` tokens;
2. all-gather over ``fsdp`` the local experts' ``E`` slices (FSDP's weight gather);
3. the local experts run on the tokens routed to them, dropless
   (:func:`rlflow.models.moe.dispatch`: sort the ``ep x n x k`` assignments by local expert,
   ``jax.lax.ragged_dot`` with the group sizes; assignments to other devices' experts sort
   after the last group and get no product);
4. reduce-scatter (sum) over ``expert`` back to each device's ``n`` tokens: a token's output
   is the gate-weighted sum of its ``k`` experts wherever they live; then sum over
   ``tensor`` (each device held ``F / tensor`` columns of every expert).

This is the "all-gather" token dispatcher of Megatron-Core's MoE (Shoeybi et al.; Megatron-Core
``moe_token_dispatcher_type="allgather"``) rather than GShard's all-to-all (Lepikhin et al.
2020, sec. 3.2). Both are dropless with static shapes only with a worst-case receive buffer of
``ep x n x k`` assignments; an all-to-all with static shapes must also send ``ep`` slots of
``n x k`` rows (k x the bytes of the gather's ``ep x n`` tokens, whatever the routing), and
the ragged all-to-all that sends only the routed rows (``jax.lax.ragged_all_to_all``) has no
XLA:CPU lowering (``UNIMPLEMENTED: HLO opcode ragged-all-to-all``), so it could not be
tested on the CPU tier. Bytes a device sends per layer, forward: gather
``(ep - 1) x n x E`` + reduce-scatter ``(ep - 1) x n x E``, the same as a ragged all-to-all
of ``n x k`` rows when ``ep = k`` (Qwen3-30B-A3B's top-8 on ``expert=8``). The collectives
in the compiled step are counted by ``benchmarks/expert_parallel.py``.

Gradients flow through the shard_map's transposes: the gathers' transposes are
reduce-scatters (expert-weight gradients summed over ``fsdp``, token gradients back to their
devices), and weights replicated over ``data`` / ``sequence`` get their gradients summed
there (``check_vma``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rlflow.mesh import batch_axes, expert_size, logical_sharding

EXPERT_AXIS = "expert"
GATE_UP_AXES = ("expert", "embed", "mlp")
"""Logical axes of the expert gate / up weights ``[X, E, F]``."""
DOWN_AXES = ("expert", "mlp", "embed")
"""Logical axes of the expert down weights ``[X, F, E]``."""

ExpertsFn = Callable[..., jax.Array]


def token_axes(mesh) -> tuple[str, ...]:
    """Mesh axes that split the tokens: :data:`rlflow.mesh.BATCH_AXES` and ``sequence``."""
    return batch_axes(mesh) + tuple(a for a in ("sequence",) if a in mesh.axis_names)


def _axis_of(spec: P, dim: int) -> tuple[str, ...]:
    axes = tuple(spec) + (None,) * (dim + 1 - len(tuple(spec)))
    a = axes[dim]
    return () if a is None else ((a,) if isinstance(a, str) else tuple(a))


def expert_ffn(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, w_gate: jax.Array,
               w_up: jax.Array, w_down: jax.Array, *, mesh=None,
               experts_fn: ExpertsFn) -> jax.Array:
    """The experts' gate-weighted output of every token, with the experts split over the
    mesh's ``expert`` axis (module doc); without a mesh, or with ``expert = 1``,
    ``experts_fn`` on all experts at once.

    Args:
      x: ``[N, E]`` tokens; expert_ids: ``[N, k]`` int; gates: ``[N, k]`` float.
      w_gate, w_up: ``[X, E, F]``; w_down: ``[X, F, E]``, all experts (sharded as
        :data:`GATE_UP_AXES` / :data:`DOWN_AXES` say on ``mesh``).
      mesh: the program's mesh (a ``Mesh`` or ``AbstractMesh``), or None.
      experts_fn: ``(x, ids, gates, w_gate, w_up, w_down, first_expert) -> [N, E]``, the
        dropless experts ``first_expert ..`` of the given weights on the tokens routed to
        them, nothing for the others (:func:`rlflow.models.moe.dispatch`).

    Returns:
      ``[N, E]`` in ``x``'s dtype.

    Raises:
      ValueError: ``X`` is not a multiple of the ``expert`` axis (names
        ``mesh.expert``).
    """
    ep = expert_size(mesh)
    if ep == 1:
        return experts_fn(x, expert_ids, gates, w_gate, w_up, w_down, 0)
    n_experts = w_gate.shape[0]
    if n_experts % ep:
        raise ValueError(f"{n_experts} experts do not split over mesh.expert={ep} devices: "
                         f"the expert axis must divide the model's expert count")
    shape = dict(mesh.shape)
    gu_spec = logical_sharding(mesh, GATE_UP_AXES, w_gate.shape).spec
    down_spec = logical_sharding(mesh, DOWN_AXES, w_down.shape).spec
    gu_embed, gu_mlp = _axis_of(gu_spec, 1), _axis_of(gu_spec, 2)
    down_embed = _axis_of(down_spec, 2)
    toks = token_axes(mesh)
    shards = math.prod(shape[a] for a in toks)
    n = x.shape[0]
    pad = -n % shards
    if pad:      # padding tokens: gate 0, expert 0 (their output is dropped below)
        x = jnp.pad(x, ((0, pad), (0, 0)))
        expert_ids = jnp.pad(expert_ids, ((0, pad), (0, 0)))
        gates = jnp.pad(gates, ((0, pad), (0, 0)))
    xl = n_experts // ep

    def body(x, ids, gates, wg, wu, wd):
        gather = lambda a: jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True)  # noqa: E731
        for axis in gu_embed:
            wg = jax.lax.all_gather(wg, axis, axis=1, tiled=True)
            wu = jax.lax.all_gather(wu, axis, axis=1, tiled=True)
        for axis in down_embed:
            wd = jax.lax.all_gather(wd, axis, axis=2, tiled=True)
        first = jax.lax.axis_index(EXPERT_AXIS) * xl
        y = experts_fn(gather(x), gather(ids), gather(gates), wg, wu, wd, first)
        y = jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, gu_mlp) if gu_mlp else y

    tok = P(toks)
    out = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, gu_spec, gu_spec, down_spec),
                        out_specs=tok)(x, expert_ids, gates, w_gate, w_up, w_down)
    return out[:n] if pad else out


def context_mesh():
    """The mesh a mixture-of-experts layer splits its experts over: the abstract mesh of
    :func:`mesh_context` (set by the decoder's forwards), or None (one device, or no
    ``expert`` axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or expert_size(mesh) == 1 else mesh


def mesh_context(mesh):
    """A context in which :func:`context_mesh` is ``mesh`` (when it has an ``expert`` axis
    of more than one device; else a no-op), usable inside a traced function."""
    if mesh is None or expert_size(mesh) == 1:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh))
