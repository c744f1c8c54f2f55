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
import torch
from flax import nnx

from hf_fixtures import PATTERN_FAMILIES, SLIDING_WINDOW, make_tiny_pattern_model
from rlflow.models import ModelFormatError, init_cache, load_hf, positions_from_mask, save_hf
from rlflow.models.config import DecoderConfig
from rlflow.models.paged_kv_cache import init_paged_cache
from family_parity import SEQS, atol, forward, hf_logits, hf_model, left_padded_logits

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
    toks = np.concatenate(SEQS)[None]
    seg = np.concatenate([np.full(len(s), i) for i, s in enumerate(SEQS)])[None]
    pos = np.concatenate([np.arange(len(s)) for s in SEQS])[None]
    mask = np.ones_like(toks, bool)
    fwd = nnx.jit(lambda m, t, p, a, s: m(t, p, a, segment_ids=s))
    ours = np.asarray(fwd(model, jnp.asarray(toks), jnp.asarray(pos, jnp.int32),
                          jnp.asarray(mask), jnp.asarray(seg, jnp.int32)))[0]
    start = 0
    for s in SEQS:
        ref = _hf_logits(path, s)
        np.testing.assert_allclose(ours[start:start + len(s)], ref, rtol=0,
                                   atol=_atol(cfg, toks.shape[1], ref))
        start += len(s)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("family", PATTERN_FAMILIES)
def test_prefill_and_decode_equal_full_forward(family_dir, family, paged):
    """Left-padded prefill of 5 then 8 decode steps (past the window) against the full
    forward; the paged cache with pages of 3 tokens in a shuffled page table."""
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
        cache = init_paged_cache(cfg, 3, num_pages=18, page_size=3, pages_per_row=6)
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


@pytest.mark.parametrize("family", PATTERN_FAMILIES)
def test_paged_engine_greedy_text_and_logprobs(family_dir, family):
    """One paged engine (pages of 4 tokens), greedy and sampled requests decoded together:
    the greedy text is transformers' ``generate``; the sampled completions' behaviour
    logprobs (temperature 1) equal one full forward over prompt + completion (the learner's
    recompute), also across a weight swap in mid-generation (:func:`_swap_in_flight`)."""
    from rlflow.config import MeshConfig, SamplerConfig
    from rlflow.mesh import make_mesh
    from rlflow.models.logprobs import token_logprobs
    from rlflow.sampler.batching import ContinuousBatcher, Request
    from rlflow.sampler.engine import RlflowEngine
    from rlflow.sampler.sampling import SamplingParams

    path = family_dir(family)
    model, cfg = load_hf(path)
    engine = RlflowEngine(model, SamplerConfig(
        num_slots=4, max_prefill_length=16, prefill_buckets=(8, 16), max_tokens=10,
        temperature=0.0, kv_cache="paged", page_size=4, decode_steps_per_call=2),
        mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    prompts = [s.tolist() for s in SEQS]
    greedy = [Request(i, p, 1, SamplingParams(temperature=0.0, max_tokens=10))
              for i, p in enumerate(prompts)]
    sampled = [Request(10 + i, p, 2, SamplingParams(temperature=1.0, max_tokens=8, seed=5 + i))
               for i, p in enumerate(prompts[:2])]
    groups = {g.prompt_id: g for g in ContinuousBatcher(engine).run(greedy + sampled)}
    hf = _hf_model(path)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                              dtype=torch.long), do_sample=False, max_new_tokens=10)
        ours = groups[i].completions[0].tokens.tolist()
        assert len(ours) > 0
        assert ours == ref[0, len(p):len(p) + len(ours)].tolist(), (family, i)
    for i, p in enumerate(prompts[:2]):
        for c in groups[10 + i].completions:
            seq = np.asarray(p + c.tokens.tolist(), np.int32)[None]
            mask = np.ones_like(seq, bool)
            logits = _forward(model, jnp.asarray(seq), positions_from_mask(mask),
                              jnp.asarray(mask))
            lp = np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(seq[:, 1:]), 1.0))[0]
            ref = lp[len(p) - 1:]
            assert seq.shape[1] > 2 * SLIDING_WINDOW
            np.testing.assert_allclose(c.logprobs, ref, rtol=0,
                                       atol=_atol(cfg, seq.shape[1], ref))
    _swap_in_flight(engine, model, cfg, prompts[0])


def _swap_in_flight(engine, model, cfg, prompt):
    """A weight swap after 2 decode calls (of 2 steps): the new weights differ in the final norm only (so
    the keys and values written under either version are the same), and every sampled
    token's logprob is the recompute under the version that sampled it."""
    from rlflow.models.logprobs import token_logprobs
    from rlflow.sampler.batching import ContinuousBatcher, Request
    from rlflow.sampler.sampling import SamplingParams

    graphdef, w0 = nnx.split(model, nnx.Param)
    w1 = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 1.5 + 0.1 if "final_norm" in jax.tree_util.keystr(path) else x, w0)
    batcher = ContinuousBatcher(engine, params=w0, version=0)
    batcher.submit(Request(0, prompt, 2, SamplingParams(temperature=1.0, max_tokens=10,
                                                        seed=9, stop_token_ids=())))
    batcher.step()
    batcher.step()
    batcher.update_params(w1, version=1)
    groups = []
    while batcher.has_work:
        groups += batcher.step()
    spans = 0
    for c in groups[0].completions:
        seq = np.asarray(prompt + c.tokens.tolist(), np.int32)[None]
        mask = jnp.ones(seq.shape, bool)
        spans += int((c.versions == 0).any() and (c.versions == 1).any())
        for v, w in ((0, w0), (1, w1)):
            logits = _forward(nnx.merge(graphdef, w), jnp.asarray(seq),
                              positions_from_mask(mask), mask)
            lp = np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(seq[:, 1:]), 1.0))[0]
            lp = lp[len(prompt) - 1:]
            at = np.asarray(c.versions) == v
            np.testing.assert_allclose(np.asarray(c.logprobs)[at], lp[at], rtol=0,
                                       atol=_atol(cfg, seq.shape[1], lp))
    assert spans == 2, [c.versions for c in groups[0].completions]   # each spans the swap


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
