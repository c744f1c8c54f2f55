"""The KV-cached forward of :class:`rlflow.models.decoder.Decoder` (sampler prefill and
decode): ``T`` new tokens per row against a contiguous :class:`rlflow.models.kv_cache.KVCache`
or a :class:`rlflow.models.paged_kv_cache.PagedKVCache`, every layer writing its new keys and
values into the cache before attending it, optionally recording each MoE layer's expert
choice (rollout routing replay). :meth:`Decoder.forward_cached` documents it and delegates
here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlflow.models.forward_output import ForwardOutput
from rlflow.models.gdn_cache import run_cached
from rlflow.models.kv_cache import KVCache
from rlflow.models.layer_pattern import layer_pattern, ordered_layers
from rlflow.models.paged_kv_cache import PagedKVCache, layer_attention_inputs


def write_cache(cache: jax.Array, new: jax.Array, cols: jax.Array, seq_axis: int) -> jax.Array:
    """One layer's keys or values with ``T`` new entries per row written in.

    Args:
      cache: ``[B, K, D, S]`` keys (``seq_axis`` 3) or ``[B, K, S, D]`` values (2).
      new: ``[B, T, K, D]`` new keys or values (any float dtype; rounded to the cache's).
      cols: int32 ``[B, T]`` cache positions; positions ``>= S`` are dropped.

    Returns:
      The cache with ``new[b, t]`` at position ``cols[b, t]`` of row ``b``, in its dtype.

    How (same bits either way): a scatter, done in place, except for a 2-byte cache
    (bfloat16) at ``T == 1`` (the decode step), which takes a one-hot select: one pass over
    the cache. XLA:CPU upcasts a bfloat16 scatter to float32, converting the whole cache
    there and back on every step (benchmarks/sampler_throughput.py). A prefill (``T > 1``,
    once per prompt) keeps the scatter.
    """
    b, t = cols.shape
    new = new.astype(cache.dtype)
    two_byte = jnp.dtype(cache.dtype).itemsize == 2
    if two_byte and t == 1:
        shape = [b, 1, 1, 1]
        shape[seq_axis] = cache.shape[seq_axis]
        hit = jnp.arange(cache.shape[seq_axis], dtype=jnp.int32)[None, :] == cols   # [B, S]
        at = new.transpose(0, 2, 3, 1) if seq_axis == 3 else new.swapaxes(1, 2)
        return jnp.where(hit.reshape(shape), at, cache)
    # Index arrays around a slice: the indexed shape is [B, T, K, D], new's.
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    index = (rows, slice(None), slice(None), cols) if seq_axis == 3 else (rows, slice(None), cols)
    return cache.at[index].set(new, mode="drop")


def forward_cached(model, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                   cache: KVCache | PagedKVCache, cache_index: jax.Array,
                   return_routing: bool = False):
    """:meth:`rlflow.models.decoder.Decoder.forward_cached` of ``model`` (arguments, shapes,
    results and errors there), under the caller's expert-parallel mesh context.

    ``model``: a :class:`rlflow.models.decoder.Decoder` with stacked ``layers``, or the
    sampler engine's view of one whose ``layers`` is an ``nnx.List`` of blocks.
    """
    model._check_tokens(tokens)
    if return_routing and not model.cfg.is_moe:
        raise ValueError("return_routing: a dense model has no experts to report")
    b, t = tokens.shape
    s = cache.max_len
    cache_index = jnp.asarray(cache_index, jnp.int32).reshape(b)
    cols = cache_index[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]     # [B, T]
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    new_mask = cache.mask.at[rows, cols].set(jnp.asarray(attention_mask, bool), mode="drop")
    keys = jnp.arange(s)[None, None, :]
    attend = new_mask[:, None, :] & (keys <= cols[:, :, None])
    window = model.cfg.sliding_window
    # a sliding layer sees the W cache positions ending at the query's (a row's tokens are
    # contiguous in its cache: pads only before them)
    attend_window = None if window is None else attend & (cols[:, :, None] - keys < window)
    ks, vs = list(cache.k), list(cache.v)
    paged = isinstance(cache, PagedKVCache)
    x = model._embed(tokens)
    if isinstance(model.layers, nnx.List):
        blocks = model.layers
    else:
        blocks = ordered_layers(model.layers, layer_pattern(model.cfg.kinds))
    chosen = []                                         # [B, T, k] per layer
    linear = list(cache.linear)                         # GDN states per slot (both caches)
    for layer, block in enumerate(blocks):
        if block.kind == "linear_attention":            # carried state, no keys / values
            def run(gdn, h, layer=layer):
                y, linear[layer] = run_cached(gdn, h, attention_mask, linear[layer])
                return y
            x, _ = block(x, positions, None, None, run, return_routing=True)
            if return_routing:
                raise ValueError("return_routing: linear_attention layers have no experts")
            continue
        plain = block.attn.variant.plain
        def hook(k, v, layer=layer, plain=plain):
            if paged:
                # the paged kernel computes plain attention only: the others gather
                ks[layer], vs[layer], read = layer_attention_inputs(
                    cache if plain else cache.replace(attention="gather"), ks[layer],
                    vs[layer], k, v, cols)
                return read
            ks[layer] = write_cache(ks[layer], k, cols, seq_axis=3)
            vs[layer] = write_cache(vs[layer], v, cols, seq_axis=2)
            return ks[layer].astype(k.dtype), vs[layer].astype(v.dtype)
        mask = attend if block.attn.variant.window is None else attend_window
        x, routing = block(x, positions, None, mask, hook, return_routing=True)
        if return_routing:
            chosen.append(routing.expert_ids.reshape(b, t, -1))
    if paged:
        new_cache = cache.replace(k=tuple(ks), v=tuple(vs), mask=new_mask, linear=tuple(linear))
    else:
        new_cache = KVCache(k=tuple(ks), v=tuple(vs), mask=new_mask, linear=tuple(linear))
    return ForwardOutput(logits=model._logits(x), cache=new_cache,
                         expert_ids=jnp.stack(chosen, axis=2) if return_routing else None)
