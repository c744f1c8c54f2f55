"""Layer patterns (rlflow.models.layer_pattern) and attention variants (sliding window,
sinks, softcap, score scale: rlflow.models.attention).

Oracles: a Python loop over the layers in order (for the cycle scan), numpy attention
written from the definitions (for the variants), and the jaxpr of the forward (for the
compiled program's size in depth)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlflow.models import DecoderConfig, positions_from_mask
from rlflow.models.attention import KeyQueryMask, Variant, attend
from rlflow.models.attention import SequenceMask
from rlflow.models.decoder import Decoder
from rlflow.models.layer_pattern import LayerKinds, layer_pattern, ordered_layers
from tolerances import F32_EPS, forward_atol, sum_tol

S, F = "sliding_attention", "full_attention"


def _cfg(model_type="gemma3_text", layers=5, every=3, **kw):
    kinds = tuple(F if (i + 1) % every == 0 else S for i in range(layers))
    base = dict(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=48,
                num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8, layer_types=kinds,
                sliding_window=3, qk_norm=model_type == "gemma3_text")
    if model_type == "gemma3_text":
        base.update(rope_local_theta=10000.0, rope_theta=1e6, query_pre_attn_scalar=12.0,
                    final_logit_softcapping=30.0)
    if model_type == "gpt_oss":
        base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                    norm_topk_prob=True, attention_bias=True, swiglu_alpha=1.702,
                    swiglu_limit=1.0)
    base.update(kw)
    return DecoderConfig(**base)


def _random(cfg, seed=0, scale=6.0):
    model = Decoder(cfg, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(lambda p: p * scale if p.ndim > 1 else p + 0.3, params)
    return nnx.merge(graphdef, params)


def test_layer_pattern_finds_shortest_cycle_and_slots():
    gemma = tuple(F if (i + 1) % 6 == 0 else S for i in range(26))
    p = layer_pattern(gemma)
    assert p.cycle == (S,) * 5 + (F,) and p.cycles == 4 and p.remainder == 2
    assert p.count(S) == 22 and p.count(F) == 4
    slots = [p.slot(i) for i in range(26)]
    # each kind's slots are 0..count-1 in layer order: a bijection onto the stacks
    for kind in p.kinds:
        assert [j for k, j in slots if k == kind] == list(range(p.count(kind)))
    assert [k for k, _ in slots] == list(gemma)
    assert layer_pattern((F,) * 7).cycle == (F,)
    assert layer_pattern((S, F) * 3 + (S,)).cycle == (S, F)
    assert layer_pattern((S, F, F)).cycle == (S, F, F)      # no repeat: one cycle of all


def test_single_kind_keeps_one_stack_with_layer_paths():
    cfg = DecoderConfig(num_layers=3)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    assert not isinstance(model.layers, LayerKinds)
    assert model.layers.attn.q_kernel[...].shape == (3, 64, 4, 16)


def test_stacks_per_kind_hold_each_layer():
    cfg = _cfg()
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    assert isinstance(model.layers, LayerKinds)
    assert model.layers.sliding_attention.attn.q_kernel[...].shape[0] == 4
    assert model.layers.full_attention.attn.q_kernel[...].shape[0] == 1
    layers = ordered_layers(model.layers, layer_pattern(cfg.kinds))
    assert [b.kind for b in layers] == list(cfg.kinds)
    assert [b.attn.variant.window for b in layers] == [3, 3, None, 3, 3]


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss"])
@pytest.mark.parametrize("remat", ["none", "full"])
def test_cycle_scan_equals_layer_loop(model_type, remat):
    """The scan over cycles plus remainder gives the forward of the layers run one by one in
    order, with a padded row and rows longer than the window."""
    cfg = _cfg(model_type, layers=5 if model_type == "gemma3_text" else 3, every=3 if
               model_type == "gemma3_text" else 2)
    model = _random(cfg)
    rng = np.random.RandomState(0)
    toks = jnp.asarray(rng.randint(0, cfg.vocab_size, (2, 9)), jnp.int32)
    mask = jnp.asarray(np.arange(9)[None] >= np.array([[0], [3]]))
    pos = positions_from_mask(mask)
    got = np.asarray(nnx.jit(lambda m, t, p, a: m.hidden_states(t, p, a, remat=remat).hidden)(
        model, toks, pos, mask))
    def loop(m, toks, pos, mask):
        attend_ = SequenceMask(mask, impl="xla")
        x = m._embed(toks)
        for block in ordered_layers(m.layers, layer_pattern(cfg.kinds)):
            x = block(x, pos, None, attend_)
        return m.final_norm(x)

    want = np.asarray(nnx.jit(loop)(model, toks, pos, mask))
    np.testing.assert_allclose(got[np.asarray(mask)], want[np.asarray(mask)], rtol=0,
                               atol=forward_atol(cfg, 9, float(np.abs(want).max())))


def _eqns(cfg):
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    toks = jnp.zeros((1, 8), jnp.int32)
    mask = jnp.ones((1, 8), bool)
    jaxpr = jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(toks, positions_from_mask(mask),
                                                              mask))(params)
    return len(jaxpr.jaxpr.eqns)


def test_program_size_flat_in_depth():
    """2 cycles + remainder and 8 cycles + the same remainder compile the same program
    (the layer bodies are in the scan once; only the stacked arrays grow)."""
    assert _eqns(_cfg(layers=8)) == _eqns(_cfg(layers=26))     # [s, s, f] x n + [s, s]
    assert _eqns(_cfg("gpt_oss", layers=4, every=2)) == _eqns(_cfg("gpt_oss", layers=12,
                                                                    every=2))


# ------------------------------------------------------------------ attention variants
def _np_attention(q, k, v, mask, seg, pos, var: Variant, sinks):
    """Numpy oracle, float64: causal, padding, segments, window on token positions, softcap,
    scale, sinks (one more logit per head, dropped after the softmax)."""
    b, t, h, d = q.shape
    g = h // k.shape[2]
    scale = d ** -0.5 if var.scale is None else var.scale
    out = np.zeros((b, t, h, d))
    for bi in range(b):
        for hi in range(h):
            s = (q[bi, :, hi] @ k[bi, :, hi // g].T) * scale
            if var.softcap is not None:
                s = var.softcap * np.tanh(s / var.softcap)
            ok = (np.arange(t)[None] <= np.arange(t)[:, None]) & mask[bi][None]
            ok &= seg[bi][:, None] == seg[bi][None]
            if var.window is not None:
                ok &= pos[bi][:, None] - pos[bi][None] < var.window
            s = np.where(ok, s, -1e30)
            cols = [s] + ([np.full((t, 1), sinks[hi])] if sinks is not None else [])
            full = np.concatenate(cols, axis=1)
            p = np.exp(full - full.max(axis=1, keepdims=True))
            p = p / p.sum(axis=1, keepdims=True)
            out[bi, :, hi] = p[:, :t] @ v[bi, :, hi // g]
    return out


@pytest.mark.parametrize("name", ["xla", "blockwise"])
@pytest.mark.parametrize("var", [Variant(window=3), Variant(sinks=True),
                                 Variant(window=2, softcap=2.0, scale=0.2, sinks=True)])
def test_attention_variants_match_numpy(name, var):
    rng = np.random.RandomState(1)
    b, t, h, kh, d = 2, 11, 4, 2, 8
    q, k, v = (rng.randn(b, t, n, d).astype(np.float32) for n in (h, kh, kh))
    mask = np.ones((b, t), bool)
    mask[1, :2] = False                                    # left padding
    seg = np.zeros((b, t), np.int32)
    seg[0, 6:] = 1                                         # two packed segments in row 0
    pos = np.array(positions_from_mask(jnp.asarray(mask)))
    pos[0, 6:] = np.arange(t - 6)                          # positions restart per segment
    sinks = rng.randn(h).astype(np.float32) if var.sinks else None
    m = KeyQueryMask.whole_row(jnp.asarray(mask), jnp.asarray(seg), None, jnp.asarray(pos))
    got = np.asarray(attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), m, name,
                            block_size=4, variant=var,
                            sinks=None if sinks is None else jnp.asarray(sinks)))
    want = _np_attention(q, k, v, mask, seg, pos, var, sinks)
    # scores: d-term dot products, then a t-term weighted sum of |v| <= max|v|
    tol = sum_tol(d + t + 2, float(np.abs(q).max() * np.abs(k).max() * d + np.abs(v).max()))
    np.testing.assert_allclose(got[mask], want[mask], rtol=0, atol=tol)
    assert np.isfinite(got).all()
    assert tol < 1e-3 and F32_EPS > 0


def test_kernels_refuse_variants():
    from rlflow.models.attention import resolve

    assert resolve("auto", prefix=False, backend="tpu", plain=False) == "blockwise"
    with pytest.raises(ValueError, match="sliding window"):
        resolve("splash", prefix=False, plain=False)


def test_routing_replay_and_balance_loss_follow_layer_order():
    """gpt-oss ([sliding, full] x 2 + [sliding]): the expert ids the cached forward records
    per layer, replayed through the cycle scan, agree with every layer's own choice (a
    layer fed another layer's ids would disagree), and the forward is unchanged."""
    from rlflow.models.kv_cache import init_cache

    cfg = _cfg("gpt_oss", layers=5, every=2, num_experts=8)
    model = _random(cfg, seed=2)
    rng = np.random.RandomState(3)
    toks = jnp.asarray(rng.randint(0, cfg.vocab_size, (2, 7)), jnp.int32)
    mask = jnp.ones((2, 7), bool)
    pos = positions_from_mask(mask)
    out = nnx.jit(lambda m, t, p, a, c: m.forward_cached(t, p, a, c, jnp.zeros(2, jnp.int32),
                                                         return_routing=True))(
        model, toks, pos, mask, init_cache(cfg, 2, 8))
    ids = np.asarray(out.expert_ids)                                   # [B, T, L, k]
    assert ids.shape == (2, 7, 5, 2)
    assert len({ids[:, :, i].tobytes() for i in range(5)}) == 5        # layers differ
    fwd = nnx.jit(lambda m, t, p, a, r: m.hidden_states(t, p, a, routing_ids=r,
                                                        replay_routing=True, moe_aux=True))
    res = fwd(model, toks, pos, mask, jnp.asarray(ids))
    agree = np.asarray(res.router_agreement)                           # [L, 2]
    np.testing.assert_array_equal(agree[:, 0], agree[:, 1])
    assert agree[:, 1].min() == 14 and float(res.aux_loss) > 0
    plain = nnx.jit(lambda m, t, p, a: m.hidden_states(t, p, a).hidden)(model, toks, pos, mask)
    np.testing.assert_allclose(np.asarray(res.hidden), np.asarray(plain), rtol=0,
                               atol=forward_atol(cfg, 7, float(np.abs(plain).max())))


@pytest.mark.parametrize("name", ["xla", "blockwise"])
def test_sliding_window_measures_positions_across_a_shared_prompt(name):
    """Shared-prompt packing (prompt once, two completions after it, each continuing the
    prompt's positions): a completion token's window reaches back into the prompt by
    position, not by row index (the second completion sits 3 rows further away)."""
    rng = np.random.RandomState(2)
    t, h, kh, d, w = 11, 2, 1, 8, 3
    q, k, v = (rng.randn(1, t, n, d).astype(np.float32) for n in (h, kh, kh))
    seg = np.array([[0] * 5 + [1] * 3 + [2] * 3], np.int32)
    prefix = np.zeros((1, t), np.int32)              # every segment also sees the prompt's
    pos = np.array([list(range(5)) + [5, 6, 7] * 2], np.int32)
    m = KeyQueryMask.whole_row(jnp.ones((1, t), bool), jnp.asarray(seg), jnp.asarray(prefix),
                               jnp.asarray(pos))
    got = np.asarray(attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), m, name,
                            block_size=4, variant=Variant(window=w)))
    # the second completion alone, prompt + its 3 tokens contiguous: plain rows
    idx = list(range(5)) + [8, 9, 10]
    alone = _np_attention(q[:, idx], k[:, idx], v[:, idx], np.ones((1, 8), bool),
                          np.zeros((1, 8), np.int32), pos[:, idx], Variant(window=w), None)
    tol = sum_tol(d + t + 2, float(np.abs(q).max() * np.abs(k).max() * d + np.abs(v).max()))
    np.testing.assert_allclose(got[0, 8:], alone[0, 5:], rtol=0, atol=tol)
