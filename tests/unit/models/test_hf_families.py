"""Gemma 3 (text) and gpt-oss: parity with transformers on tiny random models written by
``save_pretrained`` (tests/hf_fixtures.py), on rows longer than the sliding window, padded
and packed; KV-cached prefill + decode (contiguous and paged) against the full forward;
greedy text and the paged engine's logprobs against transformers / the learner's
recompute; export back to transformers; named refusals."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import PATTERN_FAMILIES, SLIDING_WINDOW, make_tiny_pattern_model
from rlflow.models import ModelFormatError, init_cache, load_hf, positions_from_mask, save_hf
from rlflow.models.config import DecoderConfig
from rlflow.models.paged_kv_cache import init_paged_cache
from family_parity import (SEQS, assert_packed_row_equals_each_sequence, atol, family_engine,
                           forward, greedy_text_and_logprobs, hf_logits, hf_model,
                           left_padded_logits, swap_in_flight)

_forward = forward


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    return functools.cache(lambda family: make_tiny_pattern_model(
        family, str(tmp_path_factory.mktemp(family))))


# eager: the attention that applies sinks (gpt-oss) and the sliding window as written
_hf_model = functools.partial(hf_model, attn_implementation="eager")
_hf_logits = functools.partial(hf_logits, attn_implementation="eager")
_atol = atol


@pytest.mark.parametrize("family", PATTERN_FAMILIES)
def test_logits_match_transformers_left_padded(family_dir, family):
    path = family_dir(family)
    model, cfg = load_hf(path)
    assert cfg.model_type == family and cfg.sliding_window == SLIDING_WINDOW
    assert len(set(cfg.kinds)) == 2 and max(map(len, SEQS)) > 2 * SLIDING_WINDOW
    ours, w = left_padded_logits(model)
    for b, s in enumerate(SEQS):
        ref = _hf_logits(path, s)
        assert np.abs(ref).max() > 1.0
        # rlflow vs transformers: two float32 programs (tests/tolerances.py)
        np.testing.assert_allclose(ours[b, w - len(s):], ref, rtol=0, atol=_atol(cfg, w, ref),
                                   err_msg=f"{family} row {b}")


@pytest.mark.parametrize("family", PATTERN_FAMILIES)
def test_packed_row_equals_each_sequence_alone(family_dir, family):
    """Three sequences packed in one row (segment ids, positions restarting at 0): each
    segment's logits are transformers' of the sequence alone."""
    path = family_dir(family)
    model, cfg = load_hf(path)
    assert_packed_row_equals_each_sequence(model, cfg, path, attn_implementation="eager")


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("family", PATTERN_FAMILIES)
def test_prefill_and_decode_equal_full_forward(family_dir, family, paged, monkeypatch):
    """Left-padded prefill of 5 then 8 decode steps (past the window) against the full
    forward; the paged cache with pages of 3 tokens in a shuffled page table, set to the
    TPU paged-attention kernel, which none of these layers may take (sinks, a window or
    Gemma's score scale): they gather."""
    import jax.experimental.pallas.ops.tpu.paged_attention as kernel_module

    def refuse(*args, **kwargs):
        raise AssertionError("the paged kernel computes plain D^-1/2 attention only")
    monkeypatch.setattr(kernel_module, "paged_attention", refuse)
    model, cfg = load_hf(family_dir(family))
    rng = np.random.RandomState(0)
    prompt_w, steps, lengths = 5, 8, (5, 3, 1)
    toks = np.zeros((3, prompt_w + steps), np.int32)
    mask = np.zeros_like(toks, bool)
    for b, n in enumerate(lengths):
        toks[b, prompt_w - n:] = rng.randint(1, cfg.vocab_size, n + steps)
        mask[b, prompt_w - n:] = True
    pos = positions_from_mask(jnp.asarray(mask))
    full = np.asarray(_forward(model, jnp.asarray(toks), pos, jnp.asarray(mask)))
    if paged:
        cache = init_paged_cache(cfg, 3, num_pages=18, page_size=3, pages_per_row=6,
                                 attention="kernel")
        table = rng.permutation(18).reshape(3, 6).astype(np.int32)
        cache = cache.replace(page_table=jnp.asarray(table))
    else:
        cache = init_cache(cfg, 3, 16)
    step = nnx.jit(lambda m, t, p, a, c, i: m.forward_cached(t, p, a, c, i))
    out = step(model, jnp.asarray(toks[:, :prompt_w]), pos[:, :prompt_w],
               jnp.asarray(mask[:, :prompt_w]), cache, jnp.zeros(3, jnp.int32))
    outs, cache = [np.asarray(out.logits)], out.cache
    for i in range(prompt_w, prompt_w + steps):
        out = step(model, jnp.asarray(toks[:, i:i + 1]), pos[:, i:i + 1],
                   jnp.asarray(mask[:, i:i + 1]), cache, jnp.full(3, i, jnp.int32))
        outs.append(np.asarray(out.logits))
        cache = out.cache
    cached = np.concatenate(outs, axis=1)
    np.testing.assert_allclose(cached[mask], full[mask], rtol=0,
                               atol=_atol(cfg, toks.shape[1], full[mask]))


@pytest.mark.parametrize("family", PATTERN_FAMILIES)
def test_export_loads_in_transformers_with_the_same_logits(family_dir, family, tmp_path):
    src = family_dir(family)
    model, cfg = load_hf(src)
    out = str(tmp_path / "export")
    save_hf(model, cfg, out)
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    assert c["model_type"] == family and c["layer_types"] == list(cfg.kinds)
    # float32 weights written back bit for bit: transformers' logits unchanged
    for seq in SEQS:
        np.testing.assert_array_equal(_hf_logits(out, seq), _hf_logits(src, seq))
    again, cfg2 = load_hf(out)
    assert cfg2 == cfg


def test_gpt_oss_gate_up_interleave_round_trip(family_dir, tmp_path):
    """gate columns even, up odd: the exported file holds the source's tensor exactly."""
    from safetensors.numpy import load_file

    src = family_dir("gpt_oss")
    model, cfg = load_hf(src)
    save_hf(model, cfg, str(tmp_path))
    a = load_file(os.path.join(src, "model.safetensors"))
    b = load_file(os.path.join(str(tmp_path), "model.safetensors"))
    for name in ("model.layers.1.mlp.experts.gate_up_proj",
                 "model.layers.2.mlp.experts.gate_up_proj_bias",
                 "model.layers.0.mlp.router.bias", "model.layers.1.self_attn.sinks"):
        np.testing.assert_array_equal(a[name], b[name])
    g = np.asarray(model.layers.full_attention.mlp.gate_kernel[...])[0]
    np.testing.assert_array_equal(g, a["model.layers.1.mlp.experts.gate_up_proj"][..., ::2])


@pytest.mark.parametrize("family,kv_cache", [("gemma3_text", "contiguous"),
                                             ("gemma3_text", "paged"), ("gpt_oss", "paged")])
def test_engine_greedy_text_and_logprobs(family_dir, family, kv_cache):
    """One engine, greedy and sampled requests decoded together, the sliding layers holding
    only their window (a ring of 4 entries per slot; prompts and completions longer than
    twice the window): the greedy text is transformers' ``generate``; the sampled
    completions' behaviour logprobs (temperature 1) equal one full forward over prompt +
    completion (the learner's recompute). Paged (pages of 4 tokens, a pool of 7: one
    full-length sequence): also across preemptions with re-prefill and across a weight
    swap in mid-generation (tests/family_parity.py). gpt-oss runs paged only: its rings
    run the same code in either cache, and the contiguous insert is Gemma 3's run's."""
    path = family_dir(family)
    model, cfg = load_hf(path)
    paged = kv_cache == "paged"
    engine = family_engine(model, num_pages=7 if paged else 0, kv_cache=kv_cache)
    sliding = [i for i, kind in enumerate(cfg.kinds) if kind == "sliding_attention"]
    state = jax.eval_shape(engine.init_decode_state)
    assert {state.cache.k[i].shape[-1] for i in sliding} == {SLIDING_WINDOW}   # the ring
    assert len(SEQS[0]) + 8 > 2 * SLIDING_WINDOW
    counters = greedy_text_and_logprobs(engine, model, cfg, _hf_model(path))
    if paged:
        assert counters.preemptions > 0
        assert swap_in_flight(engine, model, cfg, SEQS[0].tolist()).preemptions > 0


def test_refusals_name_the_field(family_dir):
    with open(os.path.join(family_dir("gemma3_text"), "config.json")) as f:
        gemma = json.load(f)
    with pytest.raises(ModelFormatError, match="use_bidirectional_attention"):
        DecoderConfig.from_hf_dict({**gemma, "use_bidirectional_attention": True})
    with pytest.raises(ModelFormatError, match="hidden_activation"):
        DecoderConfig.from_hf_dict({**gemma, "hidden_activation": "relu"})
    with pytest.raises(ModelFormatError, match="rope_type"):
        DecoderConfig.from_hf_dict({**gemma, "rope_parameters": {
            **gemma["rope_parameters"], "sliding_attention": {"rope_type": "linear",
                                                              "factor": 2.0}}})
    with open(os.path.join(family_dir("gpt_oss"), "config.json")) as f:
        oss = json.load(f)
    with pytest.raises(ModelFormatError, match="mscale"):
        DecoderConfig.from_hf_dict({**oss, "rope_parameters": {
            **oss["rope_parameters"], "mscale": 1.0}})
    with pytest.raises(ModelFormatError, match="layer kinds"):
        DecoderConfig.from_hf_dict({**oss, "layer_types": ["linear_attention",
                                                           "full_attention", "full_attention"]})
    # a dense family with a YaRN rope_type is refused, not silently run without it
    with pytest.raises(ModelFormatError, match="yarn"):
        DecoderConfig.from_hf_dict({"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8,
                                    "intermediate_size": 8, "num_hidden_layers": 1,
                                    "num_attention_heads": 2, "rope_scaling": {
                                        "rope_type": "yarn", "factor": 2.0}})
