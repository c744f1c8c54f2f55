"""Context parallelism: the learner's rows split along their positions over the ``sequence``
mesh axis, attention across it by an all-gather of keys and values.

Layout (:mod:`rlflow.mesh`): the learner's activations ``[B, T, ...]`` carry the logical axes
``("batch", "seq", ...)``, so with ``learner.mesh.sequence = s`` device ``i`` of the axis
holds positions ``[i T / s, (i + 1) T / s)`` of every row of its batch shard; parameters are
replicated over the axis (as over ``data``). Every token-wise part of a layer (norms, RoPE,
the projections, the MLP) then runs on the local positions with no communication: the
decoder's layers hold the residual stream in the :func:`fold`-ed view ``[s * B, T / s, E]``,
constrained to one block per device at each layer boundary
(:meth:`rlflow.models.decoder.Decoder.hidden_states`).

Attention is the one part that needs other devices' positions. It is a ``shard_map``
manual over ``sequence`` only (``data`` / ``fsdp`` / ``tensor`` stay automatic), so the
communication is the one this module states rather than what the partitioner derives from
the blockwise attention's reshapes of the split ``T`` axis into query / key blocks:
``benchmarks/context_parallel.py`` (the layers' gradient, T = 1024 over ``sequence`` = 4,
2 layers, remat "full") compiles it to 7 all-gathers and 2 reduce-scatters, against 27
all-gathers for the same attention left to XLA (temporaries 6.6 vs 6.7 MiB per device, 13.7
MiB at ``sequence`` = 1). Each device

1. all-gathers the keys and values ``[B, T/s, K, D]`` of the layer over the axis (the
   simplest correct scheme; with grouped-query attention ``K <= H``, so the gathered
   ``[B, T, K, D]`` is at most the size of the layer's queries, linear in ``T``), and the
   key-side mask operands (padding mask, segment ids);
2. keeps its queries local and attends them to the whole row with
   :func:`rlflow.models.attention.attend` (``"blockwise"`` or ``"xla"``), the causal mask and
   the packing segment / prefix ids taken at *global* positions (``axis_index * T / s +
   arange(T / s)`` for the queries, ``arange(T)`` for the keys);
3. returns its ``[B, T/s, H, D]`` output. The backward of the all-gather is a
   reduce-scatter of the key / value cotangents (JAX's transpose of ``all_gather``).

Equal to the single-device attention within float32 reordering (the same masked scores, the
same online softmax per query). Ring attention (Liu et al. 2023, "Ring Attention with
Blockwise Transformers"; keys and values passed around the axis block by block with
``ppermute``, never whole) would bound the gathered keys to one block; not built.
Contiguous chunks leave causal work unbalanced (the last device's queries see the most
keys); a striped / zig-zag assignment of positions would balance it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rlflow.mesh import sequence_size
from rlflow.models.attention import KeyQueryMask, attend, resolve

AXIS = "sequence"


def fold(x: jax.Array, sequence: int) -> jax.Array:
    """``[B, T, ...]`` -> ``[s * B, T / s, ...]``: each row cut into its ``s`` position
    spans, span ``c`` of row ``b`` at ``c * B + b`` (sequence-major). The decoder runs its
    layers on this view, its leading axis split over ``sequence x data x fsdp`` as one block
    per device: the projections' ``[B * T, E]`` matmul rows
    (:func:`rlflow.models.linear._dense`) stay on their devices, and a ``shard_map`` manual
    over ``sequence`` takes the view as it is (``P("sequence")``: device ``c`` of the axis
    gets ``[B, T / s, ...]``). Flattening ``[B, T]`` with ``T`` split but ``B`` not (or not
    one row per device) is not a block layout, and XLA all-gathers the positions there
    (measured: the MLP then ran on whole rows on every device)."""
    b, t = x.shape[:2]
    x = x.reshape((b, sequence, t // sequence) + x.shape[2:]).swapaxes(0, 1)
    return x.reshape((sequence * b, t // sequence) + x.shape[3:])


def unfold(x: jax.Array, sequence: int) -> jax.Array:
    """Inverse of :func:`fold`: ``[s * B, T / s, ...]`` -> ``[B, T, ...]``."""
    sb, tl = x.shape[:2]
    x = x.reshape((sequence, sb // sequence, tl) + x.shape[2:]).swapaxes(0, 1)
    return x.reshape((sb // sequence, tl * sequence) + x.shape[3:])


def check_length(t: int, sequence: int, where: str = "row") -> None:
    """Raise unless a row of ``t`` positions splits over a ``sequence`` axis.

    Raises:
      ValueError: ``t % sequence != 0``, naming ``learner.mesh.sequence`` and the length.
    """
    if t % sequence:
        raise ValueError(f"a {where} of {t} positions does not split over "
                         f"learner.mesh.sequence={sequence}: training row lengths "
                         f"(learner.seq_buckets, learner.pack_length) must be multiples of "
                         f"it")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh, attention_mask: jax.Array,
              segment_ids: jax.Array | None = None, prefix_ids: jax.Array | None = None,
              impl: str = "auto", block_size: int | None = None) -> jax.Array:
    """:func:`rlflow.models.attention.attention` with the positions split over ``mesh``'s
    ``sequence`` axis (module doc): same arguments and result, ``[B, T, H, D]``, each
    ``[B, T, ...]`` operand sharded ``T`` over ``sequence``.

    Args:
      mesh: the learner's mesh (a ``sequence`` axis of ``s >= 1`` devices).
      impl: as :func:`rlflow.models.attention.resolve` with ``sequence = s`` ("auto":
        "blockwise"; the kernels are refused when ``s > 1``).

    Raises:
      ValueError: ``T`` not a multiple of ``s`` (:func:`check_length`), a kernel asked for
        ``s > 1``, or as :func:`rlflow.models.attention.attention`.
    """
    s = sequence_size(mesh)
    b, t, h, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(f"attention: q {q.shape} with k {k.shape} / v {v.shape}: expected "
                         f"k, v [B, T, K, D] with H % K == 0")
    check_length(t, s)
    out = folded_attention(*(fold(x, s) for x in (q, k, v)), mesh=mesh,
                           attention_mask=attention_mask, segment_ids=segment_ids,
                           prefix_ids=prefix_ids, impl=impl, block_size=block_size)
    return unfold(out, s)


def folded_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh,
                     attention_mask: jax.Array, segment_ids: jax.Array | None = None,
                     prefix_ids: jax.Array | None = None, impl: str = "auto",
                     block_size: int | None = None) -> jax.Array:
    """:func:`attention` on the :func:`fold`-ed view (what the decoder's layers hold):
    ``q [s * B, T / s, H, D]``, ``k, v [s * B, T / s, K, D]``; the mask operands
    ``[B, T]`` as :func:`attention` takes them. Returns ``[s * B, T / s, H, D]``.

    Raises:
      ValueError: as :func:`attention`.
    """
    s = sequence_size(mesh)
    b, t = attention_mask.shape
    if q.shape[:2] != (s * b, t // s) or t % s:
        raise ValueError(f"folded attention: q {q.shape} is not the [s * B, T / s, H, D] "
                         f"view of [B, T] = {attention_mask.shape} rows over sequence={s}")
    if prefix_ids is not None and segment_ids is None:
        raise ValueError("attention: prefix_ids needs segment_ids")
    name = resolve(impl, prefix=prefix_ids is not None, sequence=s)
    row = {"valid": jnp.asarray(attention_mask, bool)}
    if segment_ids is not None:
        row["seg"] = jnp.asarray(segment_ids)
    if prefix_ids is not None:
        row["prefix"] = jnp.asarray(prefix_ids)

    def local(q, k, v, row):
        tl = q.shape[1]                                   # T / s local positions
        gather = lambda x: jax.lax.all_gather(x, AXIS, axis=1, tiled=True)  # noqa: E731
        q_pos = jax.lax.axis_index(AXIS) * tl + jnp.arange(tl)
        seg = row.get("seg")
        mask = KeyQueryMask(q_pos=q_pos, k_pos=jnp.arange(tl * s), key_valid=gather(row["valid"]),
                            q_seg=seg, k_seg=None if seg is None else gather(seg),
                            q_prefix=row.get("prefix"))
        return attend(q, gather(k), gather(v), mask, name, block_size=block_size)

    folded, rows = P(AXIS), P(None, AXIS)
    # check_vma=False: the blockwise attention's scan carries start as constants (invariant
    # over the axis) and become varying; every operand here is split over the axis, so the
    # transpose of all_gather (a reduce-scatter) is the right backward either way
    return jax.shard_map(local, mesh=mesh, in_specs=(folded, folded, folded, rows),
                         out_specs=folded, axis_names={AXIS}, check_vma=False)(q, k, v, row)
