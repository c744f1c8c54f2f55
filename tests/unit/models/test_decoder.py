"""Decoder core: KV-cache path vs full forward, left padding, masking, RoPE, tied embeddings.

Oracles: the full forward on unpadded rows (for padded / cached paths), transformers'
RoPE functions (for the Llama-3 frequencies), numpy (for positions), and an untied
copy of the tied model (for the tied gradient).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlflow.config import ModelConfig
from rlflow.models import (DecoderConfig, TokenRangeError, build_model, init_cache,
                           positions_from_mask, validate_tokens)
from rlflow.models.decoder import rope_inv_freq
from rlflow.models.logprobs import token_logprobs
from tolerances import F32_EPS, forward_atol

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")

# jitted entry points (one compilation per shape instead of op-by-op dispatch)
_forward = nnx.jit(lambda m, t, p, mask: m(t, p, mask))
_cached = nnx.jit(lambda m, t, p, mask, cache, idx: _logits_cache(
    m.forward_cached(t, p, mask, cache, idx)))


def _logits_cache(out):
    """``(logits, new cache)`` of a ``forward_cached`` result."""
    assert out.hidden is None and out.expert_ids is None        # not asked for
    return out.logits, out.cache


def _model(family, tie=None, **kw):
    tie = family != "llama" if tie is None else tie
    model, cfg = build_model(ModelConfig(model_type=family, vocab_size=128, hidden_size=32,
                                         intermediate_size=64, num_heads=4, num_kv_heads=2,
                                         head_dim=8, tie_word_embeddings=tie, init_seed=3, **kw))
    # a random model's 0.02-scale weights give nearly flat logits; scale them up so that
    # the comparisons below are not trivially satisfied
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(lambda p: p * 8.0 if p.ndim > 1 else p, params)
    return nnx.merge(graphdef, params), cfg


def test_positions_from_mask_matches_numpy():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]], bool)
    expected = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    got = np.asarray(positions_from_mask(jnp.asarray(mask)))
    np.testing.assert_array_equal(got, expected)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got[0, 2:], [0, 1, 2])


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_plus_8_decode_steps_equal_full_forward(family):
    model, cfg = _model(family)
    rng = np.random.RandomState(0)
    # left-padded prompts of lengths 5, 3, 1 (width 5), then 8 decoded tokens each
    prompt_w, steps = 5, 8
    lengths = (5, 3, 1)
    toks = np.zeros((3, prompt_w + steps), np.int32)
    mask = np.zeros_like(toks, bool)
    for b, n in enumerate(lengths):
        toks[b, prompt_w - n:] = rng.randint(1, cfg.vocab_size, n + steps)
        mask[b, prompt_w - n:] = True
    pos = positions_from_mask(jnp.asarray(mask))
    full = np.asarray(_forward(model, jnp.asarray(toks), pos, jnp.asarray(mask)))

    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def fwd(params, t, p, m, cache, idx):
        return _logits_cache(nnx.merge(graphdef, params).forward_cached(t, p, m, cache, idx))

    cache = init_cache(cfg, 3, 16)
    t_ = jnp.asarray(toks)
    logits, cache = fwd(params, t_[:, :prompt_w], pos[:, :prompt_w], mask[:, :prompt_w], cache,
                        jnp.zeros(3, jnp.int32))
    outs = [np.asarray(logits)]
    for i in range(prompt_w, prompt_w + steps):
        logits, cache = fwd(params, t_[:, i:i + 1], pos[:, i:i + 1], mask[:, i:i + 1], cache,
                            jnp.full(3, i, jnp.int32))
        outs.append(np.asarray(logits))
    cached = np.concatenate(outs, axis=1)
    assert fwd._cache_size() == 2            # one prefill and one decode compilation
    assert np.abs(full[mask]).max() > 1.0    # logits are not flat
    # two programs (prefill + decode vs one forward): tests/tolerances.py
    np.testing.assert_allclose(cached[mask], full[mask], rtol=0,
                               atol=forward_atol(cfg, toks.shape[1], np.abs(full).max()))
    np.testing.assert_array_equal(np.asarray(cache.mask)[:, :prompt_w + steps], mask)
    assert not np.asarray(cache.mask)[:, prompt_w + steps:].any()


def test_ragged_cache_index_per_row_matches_unpadded_forward():
    """Slots at different positions: right-padded prefill, then decode writes row b at its
    own cache_index (the continuous-batching layout)."""
    model, cfg = _model("qwen3")
    rng = np.random.RandomState(1)
    lengths, steps, width = (6, 2), 4, 6
    seqs = [rng.randint(1, cfg.vocab_size, n + steps).astype(np.int32) for n in lengths]
    prompt = np.zeros((2, width), np.int32)
    pmask = np.zeros((2, width), bool)
    for b, n in enumerate(lengths):
        prompt[b, :n], pmask[b, :n] = seqs[b][:n], True
    ppos = positions_from_mask(jnp.asarray(pmask))
    logits, cache = _cached(model, jnp.asarray(prompt), ppos, jnp.asarray(pmask),
                            init_cache(cfg, 2, 12), jnp.zeros(2, jnp.int32))
    got = [[np.asarray(logits[b, n - 1])] for b, n in enumerate(lengths)]
    for i in range(steps):
        idx = np.array([n + i for n in lengths], np.int32)
        tok = np.array([[seqs[b][n + i]] for b, n in enumerate(lengths)], np.int32)
        logits, cache = _cached(model, jnp.asarray(tok), jnp.asarray(idx[:, None]),
                                jnp.ones((2, 1), bool), cache, jnp.asarray(idx))
        for b in range(2):
            got[b].append(np.asarray(logits[b, 0]))
    for b, n in enumerate(lengths):
        s = jnp.asarray(seqs[b][None])
        ref = np.asarray(_forward(model, s, positions_from_mask(jnp.ones_like(s, bool)),
                                  jnp.ones_like(s, bool)))[0]
        np.testing.assert_allclose(np.stack(got[b]), ref[n - 1:], rtol=0,
                                   atol=forward_atol(cfg, len(seqs[b]), np.abs(ref).max()))


@pytest.mark.parametrize("pads", [0, 2, 5])
def test_left_padding_gives_unpadded_logprobs(pads):
    model, cfg = _model("llama")
    real = np.array([11, 12, 13, 14, 15], np.int32)
    row = np.concatenate([np.zeros(pads, np.int32), real])[None]
    mask = (np.arange(row.shape[1]) >= pads)[None]
    pos = positions_from_mask(jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(pos)[0, pads:], np.arange(5))

    def lp(tokens, m, p):
        logits = _forward(model, jnp.asarray(tokens), p, jnp.asarray(m))
        return np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(tokens[:, 1:])))[0]

    padded = lp(row, mask, pos)[-2:]          # logprobs of tokens 14 and 15
    plain = lp(real[None], np.ones((1, 5), bool), jnp.arange(5)[None])[-2:]
    # logprobs: logits through a log-softmax (|logprob| <= |logit| + log V scale)
    np.testing.assert_allclose(padded, plain, rtol=0,
                               atol=forward_atol(cfg, row.shape[1], np.abs(plain).max()))
    assert np.all(plain < 0)


def test_fully_masked_row_is_finite():
    model, cfg = _model("qwen2")
    toks = jnp.asarray([[0, 0, 0, 0], [5, 6, 7, 8]], jnp.int32)
    mask = jnp.asarray([[False] * 4, [True] * 4])
    logits = np.asarray(_forward(model, toks, positions_from_mask(mask), mask))
    assert np.isfinite(logits).all()
    cached, _ = _cached(model, toks, positions_from_mask(mask), mask, init_cache(cfg, 2, 4),
                        jnp.zeros(2, jnp.int32))
    assert np.isfinite(np.asarray(cached)).all()


def _llama3_rope_rtol(s) -> float:
    """Relative bound between two float32 evaluations (numpy, torch) of the Llama-3 scaled
    inverse frequencies, the same formula in the same order. The exponents ``arange / d``
    round identically (correctly rounded division); ``theta ** x`` differs by <= 1 ulp per
    library (2 eps), ``1 / .`` adds eps: r1 = 3 eps on the unscaled frequency. ``wavelen =
    2 pi / inv`` adds 2 roundings; ``smooth = (old / wavelen - lo) / (hi - lo)`` is used where
    ``old / wavelen`` lies in [lo, hi], so its absolute error is hi (r1 + 2 eps) / (hi - lo)
    + eps (the subtraction cancels). ``smoothed = scaled ((1 - smooth) / f + smooth)`` is at
    least scaled / f, so an error d in smooth moves it by (f - 1) d relative; its own 4
    roundings and r1 add 2 eps + r1."""
    f, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    r1 = 3 * F32_EPS
    d_smooth = hi * (r1 + 2 * F32_EPS) / (hi - lo) + F32_EPS
    return r1 + 2 * F32_EPS + (f - 1) * d_smooth


def test_llama3_rope_frequencies_match_transformers():
    import torch  # noqa: F401  (transformers' rope functions are torch code)
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                     rope_parameters={**scaling, "rope_theta": 500000.0})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    cfg = DecoderConfig(head_dim=16, rope_theta=500000.0, rope_scaling=scaling)
    got = rope_inv_freq(cfg)
    np.testing.assert_allclose(got, expected.numpy(), rtol=_llama3_rope_rtol(scaling))
    plain = rope_inv_freq(cfg.replace(rope_scaling=None))
    assert (got < plain).any() and (got == plain).any()   # scaled low freqs, kept high freqs


def test_token_ids_out_of_range_raise():
    model, cfg = _model("llama")
    bad = jnp.asarray([[1, 2, cfg.vocab_size]], jnp.int32)
    with pytest.raises(TokenRangeError, match=r"token id 128 at index \(0, 2\).*vocab_size 128"):
        model(bad, jnp.arange(3)[None], jnp.ones((1, 3), bool))
    with pytest.raises(TokenRangeError, match="prompt 7: token id -1"):
        validate_tokens(np.array([3, -1]), cfg.vocab_size, where="prompt 7")
    validate_tokens(np.array([0, cfg.vocab_size - 1]), cfg.vocab_size)   # in range: no error


def test_tied_model_has_one_embedding_and_gradient_reaches_both_uses():
    model, cfg = _model("qwen2", tie=True)
    _, params = nnx.split(model, nnx.Param)
    leaves = jax.tree.leaves(params)
    vocab_arrays = [p for p in leaves if cfg.vocab_size in p.shape]
    assert len(vocab_arrays) == 1 and model.lm_head is None

    toks = jnp.asarray([[3, 9, 27, 81, 5]], jnp.int32)
    mask = jnp.ones_like(toks, bool)
    pos = positions_from_mask(mask)

    def loss(m):
        return -token_logprobs(m(toks, pos, mask)[:, :-1], toks[:, 1:]).sum()

    grad = nnx.jit(nnx.grad(loss))
    g_tied = grad(model).embed[...]

    # the same function with the two uses split into independent arrays
    untied, _ = _model("qwen2", tie=False)
    graphdef_u, uparams = nnx.split(untied, nnx.Param)
    pure = params.to_pure_dict()
    pure["lm_head"] = pure["embed"].T
    nnx.replace_by_pure_dict(uparams, pure)
    untied = nnx.merge(graphdef_u, uparams)
    np.testing.assert_allclose(np.asarray(_forward(untied, toks, pos, mask)),
                               np.asarray(_forward(model, toks, pos, mask)), atol=1e-6)
    g = grad(untied)
    g_in, g_out = np.asarray(g.embed[...]), np.asarray(g.lm_head[...])
    assert np.abs(g_in).max() > 0 and np.abs(g_out).max() > 0
    np.testing.assert_allclose(np.asarray(g_tied), g_in + g_out.T, atol=1e-5)

    # one SGD step moves the (single) array used for input and output projection
    before = np.asarray(model.embed[...]).copy()
    model.embed[...] = model.embed[...] - 0.1 * g_tied
    after = np.asarray(model.embed[...])
    changed_rows = np.abs(after - before).max(axis=1) > 0
    assert changed_rows.sum() > len(set(np.asarray(toks[0]).tolist()))  # output rows too


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_params_and_activations(family):
    model32, _ = _model(family)
    model16, cfg16 = _model(family, dtype="bfloat16", param_dtype="bfloat16")
    _, p16 = nnx.split(model16, nnx.Param)
    assert {p.dtype for p in jax.tree.leaves(p16)} == {jnp.dtype(jnp.bfloat16)}
    toks = jnp.asarray([[0, 4, 8, 15, 16, 23, 42]], jnp.int32)
    mask = toks != 0
    pos = positions_from_mask(mask)
    l32 = np.asarray(_forward(model32, toks, pos, mask))[0, 1:]
    l16 = _forward(model16, toks, pos, mask)
    assert l16.dtype == jnp.float32
    l16 = np.asarray(l16)[0, 1:]
    assert np.isfinite(l16).all()
    # bf16 rounding of the same weights: close, not equal
    assert np.abs(l16 - l32).max() < 0.1 * np.abs(l32).max()
    assert np.abs(l16 - l32).max() > 0
    cache = init_cache(cfg16, 1, 8)
    assert {k.dtype for k in cache.k + cache.v} == {jnp.dtype(jnp.bfloat16)}


def test_decoder_config_rejects_bad_values():
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; supported: llama, qwen2, qwen3"):
        DecoderConfig(model_type="gpt2")
    with pytest.raises(ValueError, match="num_kv_heads"):
        DecoderConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="rope_scaling.*'dynamic'"):
        DecoderConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="yarn scaling is missing.*original_max_position"):
        DecoderConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="sliding_window"):
        DecoderConfig(num_layers=2, layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="layer_types"):
        DecoderConfig(num_layers=2, layer_types=("full_attention",))
    hash(DecoderConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}))


# ---------------------------------------------------------------- bfloat16 decode kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("seq_axis", [2, 3])
def test_write_cache_matches_numpy_assignment(dtype, t, seq_axis):
    """Both paths of write_cache (the scatter; bf16's one-hot select at T == 1) place new[b, t] at cols[b, t], drops positions >= S, and leaves the rest."""
    from rlflow.models.decoder import write_cache
    rng = np.random.default_rng(t * 10 + seq_axis)
    b, k, d, s = 3, 2, 4, 6
    shape = (b, k, d, s) if seq_axis == 3 else (b, k, s, d)
    cache = rng.standard_normal(shape).astype(jnp.dtype(dtype))
    new = rng.standard_normal((b, t, k, d)).astype(np.float32)       # rounded by the write
    cols = np.array([[0, 1, 2][:t], [3, 4, 5][:t], [5, 6, 7][:t]], np.int32)  # row 2: past S
    want = np.array(cache)
    for i in range(b):
        for j in range(t):
            if cols[i, j] < s:
                val = new[i, j].astype(jnp.dtype(dtype))              # [K, D]
                if seq_axis == 3:
                    want[i, :, :, cols[i, j]] = val
                else:
                    want[i, :, cols[i, j], :] = val
    got = jax.jit(write_cache, static_argnums=3)(jnp.asarray(cache), jnp.asarray(new),
                                                 jnp.asarray(cols), seq_axis)
    assert got.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


def test_dense_bfloat16_accumulates_in_float32_and_rounds_once():
    """bf16 x bf16 -> the float32 product of the same bf16 values, rounded once to bf16
    (oracle: numpy float64 matmul). Float32 accumulation over K = 512 terms errs by at most
    sum_tol(512) relative to the terms' absolute sum, far below a bf16 half-ulp, so the
    result is within one bf16 rounding (a bf16-accumulated sum errs by ~sqrt(K) of them)."""
    from rlflow.models.decoder import _dense
    from tolerances import BF16_EPS, sum_tol
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 512)).astype(jnp.bfloat16)
    w = rng.standard_normal((512, 7)).astype(jnp.bfloat16)
    got = jax.jit(_dense)(jnp.asarray(x), jnp.asarray(w))
    assert got.dtype == jnp.bfloat16
    exact = x.astype(np.float64) @ w.astype(np.float64)
    abs_sum = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64))
    err = np.abs(np.asarray(got, np.float64) - exact)
    # one bf16 rounding of the result plus the float32 accumulation error
    assert (err <= BF16_EPS * np.abs(exact) + sum_tol(512) * abs_sum).all()


def test_bfloat16_batched_prefill_and_decode_run_and_track_float32():
    """A bf16 model's batched prefill (B = 2, T = 4: the batched attention dot) and decode
    step (T = 1: the one-hot cache write) run on CPU and stay near the float32 model's
    logits (bf16 rounding of the same weights: close, not equal)."""
    outs = {}
    for dtype in ("float32", "bfloat16"):
        model, cfg = _model("qwen2", dtype=dtype, param_dtype=dtype)
        toks = jnp.asarray([[5, 9, 17, 33], [7, 11, 13, 0]], jnp.int32)
        mask = toks != 0
        pos = positions_from_mask(mask)
        cache = init_cache(cfg, 2, 6)
        pre, cache = _cached(model, toks, pos, mask, cache, jnp.zeros((2,), jnp.int32))
        idx = jnp.asarray([4, 3], jnp.int32)
        nxt = jnp.asarray([[40], [41]], jnp.int32)
        dec, cache = _cached(model, nxt, idx[:, None], jnp.ones((2, 1), bool), cache, idx)
        assert {k.dtype for k in cache.k} == {jnp.dtype(dtype)}
        outs[dtype] = np.concatenate([np.asarray(pre)[0], np.asarray(pre)[1, :3],
                                      np.asarray(dec)[:, 0]])
    l32, l16 = outs["float32"], outs["bfloat16"]
    assert np.isfinite(l16).all()
    assert 0 < np.abs(l16 - l32).max() < 0.1 * np.abs(l32).max()
