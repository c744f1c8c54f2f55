"""Qwen3.5 text (``qwen3_5_text``: gated DeltaNet + gated full attention): parity with
transformers' ``Qwen3_5ForCausalLM`` on a tiny random model written by ``save_pretrained``
(tests/hf_fixtures.py), padded and packed; the cached forward (carried DeltaNet state)
against the full forward; greedy text of the engine against ``generate``; the engine's
behaviour logprobs against the learner's recompute; export back to transformers; refusals."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from hf_fixtures import make_tiny_qwen35
from rlflow.models import init_cache, load_hf, positions_from_mask, save_hf
from rlflow.models.paged_kv_cache import init_paged_cache
from family_parity import (SEQS, assert_packed_row_equals_each_sequence, atol, family_engine,
                           forward, greedy_text_and_logprobs, hf_logits, hf_model,
                           left_padded_logits, swap_in_flight)

_forward = forward


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    return make_tiny_qwen35(str(tmp_path_factory.mktemp("qwen35")))


_hf_model, _hf_logits = hf_model, hf_logits
_atol = atol


def test_config_reads_the_pattern_and_gated_attention(qwen35_dir):
    model, cfg = load_hf(qwen35_dir)
    assert cfg.kinds == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 2
    assert cfg.attn_output_gate and cfg.rotary_dim == 4 and cfg.offset_norms
    assert model.layers.full_attention.attn.q_kernel.shape == (1, 64, 4, 32)
    assert model.layers.linear_attention.attn.conv_v.shape == (5, 4, 4, 12)


def test_logits_match_transformers_left_padded(qwen35_dir):
    model, cfg = load_hf(qwen35_dir)
    ours, w = left_padded_logits(model)
    for b, s in enumerate(SEQS):
        ref = _hf_logits(qwen35_dir, s)
        assert np.abs(ref).max() > 1.0
        np.testing.assert_allclose(ours[b, w - len(s):], ref, rtol=0, atol=_atol(cfg, w, ref),
                                   err_msg=f"row {b}")


def test_packed_row_equals_each_sequence_alone(qwen35_dir):
    """Three sequences packed in one row (segment ids: the DeltaNet state and conv window
    restart; positions restarting at 0): each segment's logits are transformers' alone."""
    model, cfg = load_hf(qwen35_dir)
    assert_packed_row_equals_each_sequence(model, cfg, qwen35_dir)


@pytest.mark.parametrize("left", [True, False])
def test_prefill_and_decode_equal_full_forward(qwen35_dir, left):
    """Prefill of 5 (left-padded rows, or right-padded ones as the engine's prefill and
    extend write them, their real tokens first) then decode steps, the DeltaNet layers
    carrying (conv window, recurrent state) per row; right padding: each row's decode starts
    at its own length, so its state must be that of its last real token."""
    model, cfg = load_hf(qwen35_dir)
    rng = np.random.RandomState(0)
    prompt_w, steps, lengths = 5, 6, (5, 3, 1)
    step = nnx.jit(lambda m, t, p, a, c, i: m.forward_cached(t, p, a, c, i))
    seqs = [rng.randint(1, cfg.vocab_size, n + steps).astype(np.int32) for n in lengths]
    toks = np.zeros((3, prompt_w), np.int32)
    mask = np.zeros_like(toks, bool)
    for b, n in enumerate(lengths):
        at = slice(prompt_w - n, prompt_w) if left else slice(0, n)
        toks[b, at], mask[b, at] = seqs[b][:n], True
    pos = positions_from_mask(jnp.asarray(mask)) if left else jnp.broadcast_to(
        jnp.arange(prompt_w, dtype=jnp.int32), (3, prompt_w))
    out = step(model, jnp.asarray(toks), pos, jnp.asarray(mask), init_cache(cfg, 3, 16),
               jnp.zeros(3, jnp.int32))
    logits, cache = np.asarray(out.logits), out.cache
    got = [[logits[b, prompt_w - 1 if left else n - 1]] for b, n in enumerate(lengths)]
    index = np.full(3, prompt_w) if left else np.array(lengths)
    for i in range(steps - 1):
        t = np.array([seqs[b][n + i] for b, n in enumerate(lengths)], np.int32)[:, None]
        p = np.array([n + i for n in lengths], np.int32)[:, None]
        out = step(model, jnp.asarray(t), jnp.asarray(p), jnp.ones((3, 1), bool), cache,
                   jnp.asarray(index + i, jnp.int32))
        cache = out.cache
        for b in range(3):
            got[b].append(np.asarray(out.logits)[b, 0])
    for b, n in enumerate(lengths):
        s = seqs[b][:n + steps - 1]
        full = np.asarray(_forward(model, jnp.asarray(s[None]),
                                   jnp.arange(len(s), dtype=jnp.int32)[None],
                                   jnp.ones((1, len(s)), bool)))[0, n - 1:]
        np.testing.assert_allclose(np.stack(got[b]), full, rtol=0,
                                   atol=_atol(cfg, len(s), full), err_msg=f"row {b}")


def test_export_loads_in_transformers_with_the_same_logits(qwen35_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    model, cfg = load_hf(qwen35_dir)
    out = str(tmp_path / "export")
    save_hf(model, cfg, out, source_dir=qwen35_dir)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    src = _hf_model(qwen35_dir)
    for name, p in src.state_dict().items():
        np.testing.assert_array_equal(hf.state_dict()[name].numpy(), p.numpy(), err_msg=name)
    again, _ = load_hf(out)
    s = SEQS[0]
    ones = jnp.ones((1, len(s)), bool)
    np.testing.assert_array_equal(
        np.asarray(_forward(again, jnp.asarray(s[None]), positions_from_mask(ones), ones)),
        np.asarray(_forward(model, jnp.asarray(s[None]), positions_from_mask(ones), ones)))


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_engine_greedy_text_and_logprobs(qwen35_dir, kv_cache):
    """Greedy and sampled requests decoded together, two samples per sampled prompt in slots
    of their own (the prefix's DeltaNet state copied into each): the greedy text is
    transformers' ``generate``, the behaviour logprobs equal one full forward over prompt +
    completion (float32). Paged (pages of 4, a pool of 7: one full-length sequence): the
    DeltaNet states per slot beside the attention layer's pages, across preemptions with
    re-prefill (state recomputed from prompt + tokens so far) and a weight swap in
    mid-generation (tests/family_parity.py)."""
    model, cfg = load_hf(qwen35_dir)
    paged = kv_cache == "paged"
    engine = family_engine(model, num_pages=7 if paged else 0, kv_cache=kv_cache)
    counters = greedy_text_and_logprobs(engine, model, cfg, _hf_model(qwen35_dir))
    if paged:
        assert counters.preemptions > 0
        assert swap_in_flight(engine, model, cfg, SEQS[0].tolist()).preemptions > 0


def test_refusals_name_the_setting(qwen35_dir):
    from rlflow.models.lora import LoraSpec
    from rlflow.models.decoder import Decoder
    _, cfg = load_hf(qwen35_dir)
    with pytest.raises(ValueError, match="sampler.kv_cache='paged'"):
        init_paged_cache(cfg.replace(layer_types=("linear_attention",) * cfg.num_layers), 2,
                         num_pages=4, page_size=4, pages_per_row=2)
    with pytest.raises(ValueError, match="learner.lora"):
        Decoder(cfg.replace(layer_types=("linear_attention",) * cfg.num_layers),
                rngs=nnx.Rngs(0), lora=LoraSpec(rank=2, alpha=4.0))
    from rlflow.config import ExperimentConfig, LearnerConfig, ModelConfig
    from rlflow.learner.trainer import Learner
    exp = ExperimentConfig(model=ModelConfig(path=qwen35_dir),
                           learner=LearnerConfig(shared_prefix=True, packing=True))
    with pytest.raises(ValueError, match="learner.shared_prefix=False"):
        Learner(exp, devices=jax.devices()[:1])


def test_config_refusals_name_the_field(qwen35_dir):
    import json
    import os

    from rlflow.models import ModelFormatError
    from rlflow.models.config import DecoderConfig
    with open(os.path.join(qwen35_dir, "config.json")) as f:
        d = json.load(f)
    cfg = DecoderConfig.from_hf_dict(d)
    assert DecoderConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    bad = dict(d, rope_parameters=dict(d["rope_parameters"], rope_type="yarn", factor=2.0))
    with pytest.raises(ModelFormatError, match="rope_parameters.rope_type"):
        DecoderConfig.from_hf_dict(bad)
    with pytest.raises(ModelFormatError, match="linear_num_value_heads"):
        DecoderConfig.from_hf_dict({k: v for k, v in d.items() if k != "linear_num_value_heads"})
    with pytest.raises(ModelFormatError, match="gdn"):
        cfg.replace(gdn=None)
    with pytest.raises(ModelFormatError, match="partial_rotary_factor"):
        cfg.replace(partial_rotary_factor=0.1)


def test_released_configs_read_without_a_dense_mlp_width():
    """transformers' own Qwen3.5 / Qwen3.5-MoE configs (their defaults: Qwen3.5-27B and
    Qwen3.5-35B-A3B's shapes) read; a Qwen3.5-MoE config.json has no ``intermediate_size``."""
    import transformers

    from rlflow.models.config import DecoderConfig
    d = transformers.Qwen3_5MoeTextConfig().to_dict()
    assert "intermediate_size" not in d
    moe = DecoderConfig.from_hf_dict(d)
    assert (moe.num_layers, moe.num_experts, moe.kinds.count("full_attention")) == (40, 256, 10)
    assert moe.intermediate_size == moe.moe_intermediate_size == 512
    dense = DecoderConfig.from_hf_dict(transformers.Qwen3_5TextConfig().to_dict())
    assert (dense.intermediate_size, dense.gdn["num_v_heads"]) == (12288, 32)


def test_moe_logits_match_transformers_and_export_round_trips(tmp_path):
    """``qwen3_5_moe_text``: every MLP top-2 of 4 experts plus the sigmoid-gated shared
    expert; logits of padded rows equal ``Qwen3_5MoeForCausalLM``'s, and the export holds
    the source's tensors bit for bit."""
    from safetensors.numpy import load_file
    path = make_tiny_qwen35(str(tmp_path / "moe"), moe=True)
    model, cfg = load_hf(path)
    assert cfg.is_moe and cfg.shared_expert_intermediate_size == 48
    ours, w = left_padded_logits(model)
    for b, s in enumerate(SEQS):
        ref = _hf_logits(path, s)
        np.testing.assert_allclose(ours[b, w - len(s):], ref, rtol=0, atol=_atol(cfg, w, ref))
    save_hf(model, cfg, str(tmp_path / "export"), source_dir=path)
    src, out = (load_file(os.path.join(p, "model.safetensors"))
                for p in (path, str(tmp_path / "export")))
    assert sorted(src) == sorted(out)
    for name in src:
        np.testing.assert_array_equal(out[name], src[name], err_msg=name)


def test_right_padded_chunk_continues_a_carried_state(qwen35_dir):
    """Two right-padded chunks per row (as the engine's extend writes a turn's new tokens
    after the slot's own): the second starts from the first's DeltaNet state at each row's
    own length, and its logits at real tokens equal the full forward's."""
    model, cfg = load_hf(qwen35_dir)
    rng = np.random.RandomState(1)
    first, second = (4, 2, 3), (2, 4, 1)
    seqs = [rng.randint(1, cfg.vocab_size, a + b).astype(np.int32)
            for a, b in zip(first, second)]
    step = nnx.jit(lambda m, t, p, a, c, i: m.forward_cached(t, p, a, c, i))
    cache, index, outs = init_cache(cfg, 3, 16), np.zeros(3, np.int32), []
    for chunk in (first, second):
        w = max(chunk)
        toks, mask = np.zeros((3, w), np.int32), np.zeros((3, w), bool)
        for b, n in enumerate(chunk):
            toks[b, :n], mask[b, :n] = seqs[b][index[b]:index[b] + n], True
        pos = index[:, None] + np.arange(w, dtype=np.int32)[None]
        out = step(model, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(mask), cache,
                   jnp.asarray(index))
        cache = out.cache
        outs.append([np.asarray(out.logits)[b, :n] for b, n in enumerate(chunk)])
        index = index + np.array(chunk, np.int32)
    for b, s in enumerate(seqs):
        ones = jnp.ones((1, len(s)), bool)
        full = np.asarray(_forward(model, jnp.asarray(s[None]), positions_from_mask(ones),
                                   ones))[0]
        got = np.concatenate([outs[0][b], outs[1][b]])
        np.testing.assert_allclose(got, full, rtol=0, atol=_atol(cfg, len(s), full),
                                   err_msg=f"row {b}")
