"""The KV-cached forward of :class:`rlflow.models.decoder.Decoder` (sampler prefill and
decode): ``T`` new tokens per row against a contiguous
:class:`rlflow.models.kv_cache.KVCache` or a
:class:`rlflow.models.paged_kv_cache.PagedKVCache`, every layer writing its new keys and
values into the cache before attending it (a sliding-window layer attends its ring of the
window joined with the new tokens, then writes them: :mod:`rlflow.models.window_cache`; a
gated DeltaNet layer runs from each row's carried state: :mod:`rlflow.models.gdn_cache`),
optionally recording each MoE layer's expert choice (rollout routing replay).
:meth:`Decoder.forward_cached` documents it and delegates here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlflow.models.forward_output import ForwardOutput
from rlflow.models.gdn_cache import run_cached
from rlflow.models.kv_cache import KVCache, write_cache  # noqa: F401 (imported from here too)
from rlflow.models.layer_pattern import layer_pattern, ordered_layers
from rlflow.models.paged_kv_cache import PagedKVCache, layer_attention_inputs
from rlflow.models.window_cache import ring_mask, ring_update


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
    attend = new_mask[:, None, :] & (jnp.arange(s)[None, None, :] <= cols[:, :, None])
    token_mask = jnp.asarray(attention_mask, bool)
    ring_masks = {}        # a sliding layer's ring of R entries: [B, T, R + T] (one per R)
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
        window = block.attn.variant.window
        if window is not None:                          # the window only: a ring per row
            r = ks[layer].shape[3]
            if r not in ring_masks:
                ring_masks[r] = ring_mask(r, cols, token_mask, cache.mask, window)

            def ring(k, v, layer=layer):
                ks[layer], vs[layer], read = ring_update(ks[layer], vs[layer], k, v, cols,
                                                         token_mask)
                return read
            x, routing = block(x, positions, None, ring_masks[r], ring, return_routing=True)
            if return_routing:
                chosen.append(routing.expert_ids.reshape(b, t, -1))
            continue
        # the paged kernel computes plain attention scaled by D^-1/2 only: the others gather
        plain = block.attn.variant.plain and block.attn.variant.scale is None
        def hook(k, v, layer=layer, plain=plain):
            if paged:
                ks[layer], vs[layer], read = layer_attention_inputs(
                    cache if plain else cache.replace(attention="gather"), ks[layer],
                    vs[layer], k, v, cols)
                return read
            ks[layer] = write_cache(ks[layer], k, cols, seq_axis=3)
            vs[layer] = write_cache(vs[layer], v, cols, seq_axis=2)
            return ks[layer].astype(k.dtype), vs[layer].astype(v.dtype)
        x, routing = block(x, positions, None, attend, hook, return_routing=True)
        if return_routing:
            chosen.append(routing.expert_ids.reshape(b, t, -1))
    if paged:
        new_cache = cache.replace(k=tuple(ks), v=tuple(vs), mask=new_mask, linear=tuple(linear))
    else:
        new_cache = KVCache(k=tuple(ks), v=tuple(vs), mask=new_mask, linear=tuple(linear))
    return ForwardOutput(logits=model._logits(x), cache=new_cache,
                         expert_ids=jnp.stack(chosen, axis=2) if return_routing else None)
