"""Qwen3-MoE (issue 40 item 1): routing and dropless dispatch against numpy oracles, logits and
greedy text against transformers' ``Qwen3MoeForCausalLM`` (tiny random models built here),
HF export, and the refused config layouts."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from hf_fixtures import make_tiny_hf_moe_model
from rlflow.models import ModelFormatError, load_hf, positions_from_mask, save_hf
from rlflow.models.config import DecoderConfig
from rlflow.models.moe import balance_loss, balance_sums, dispatch, route
from tolerances import F32_EPS, forward_atol, sum_tol

_forward = nnx.jit(lambda m, t, p, mask: m(t, p, mask))

SEQS = [np.array(s, np.int32) for s in
        ([17, 200, 31, 4, 99, 250, 8, 64, 128], [5, 77, 190, 3, 42], [211, 9])]
CASES = [(1, False), (1, True), (2, False), (2, True), (8, False), (8, True)]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    cache = {}

    def get(k, norm):
        if (k, norm) not in cache:
            out = tmp_path_factory.mktemp(f"moe_{k}_{norm}")
            cache[k, norm] = make_tiny_hf_moe_model(str(out), top_k=k, norm_topk_prob=norm)
        return cache[k, norm]
    return get


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logits(ref, seq):
    with torch.no_grad():
        return ref(input_ids=torch.tensor(seq[None], dtype=torch.long)).logits[0].numpy()


# ------------------------------------------------------------------------------ oracles
def _np_route(logits, k, norm, replay=None):
    z = logits - logits.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k] if replay is None else replay
    g = np.take_along_axis(p, ids, -1)
    return ids, (g / g.sum(-1, keepdims=True) if norm else g), p


@pytest.mark.parametrize("k,norm", [(1, False), (2, True), (3, False)])
def test_route_matches_numpy_and_replay_uses_the_given_ids(k, norm):
    rng = np.random.RandomState(k)
    logits = rng.randn(11, 6).astype(np.float32) * 2
    r = route(jnp.asarray(logits), k, norm)
    ids, gates, probs = _np_route(logits.astype(np.float64), k, norm)
    np.testing.assert_array_equal(np.asarray(r.expert_ids), ids)
    # softmax over n = 6 terms, then a sum of k gates: float32 rounding of short sums
    np.testing.assert_allclose(np.asarray(r.gates), gates, rtol=sum_tol(6 + k), atol=0)
    np.testing.assert_allclose(np.asarray(r.probs), probs, rtol=sum_tol(6), atol=0)
    replay = rng.randint(0, 6, (11, k))
    rr = route(jnp.asarray(logits), k, norm, jnp.asarray(replay, jnp.int8))
    _, want, _ = _np_route(logits.astype(np.float64), k, norm, replay)
    assert rr.expert_ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(rr.expert_ids), replay)
    np.testing.assert_allclose(np.asarray(rr.gates), want, rtol=sum_tol(6 + k), atol=0)
    # the replayed gates carry the router's gradient
    grad = jax.grad(lambda z: jnp.sum(route(z, k, norm, jnp.asarray(replay)).gates ** 2))(
        jnp.asarray(logits))
    assert np.all(np.isfinite(grad)) and np.any(np.asarray(grad) != 0)
    with pytest.raises(ValueError, match="replay_ids must be"):
        route(jnp.asarray(logits), k, norm, jnp.zeros((11, k + 1), jnp.int32))


def test_dropless_dispatch_equals_a_loop_over_tokens_and_experts():
    rng = np.random.RandomState(0)
    n, e, f, tokens, k = 5, 8, 6, 13, 2
    x = rng.randn(tokens, e).astype(np.float32)
    wg, wu = rng.randn(n, e, f).astype(np.float32), rng.randn(n, e, f).astype(np.float32)
    wd = rng.randn(n, f, e).astype(np.float32)
    ids = rng.randint(0, n, (tokens, k))
    ids[:, 1] = np.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % n, ids[:, 1])
    ids[:, :] = np.where(np.arange(tokens)[:, None] < 7, ids, [[3, 4]])   # expert 0..2 skew
    gates = rng.rand(tokens, k).astype(np.float32)
    got = np.asarray(dispatch(*map(jnp.asarray, (x, ids, gates, wg, wu, wd))))
    want = np.zeros((tokens, e))
    silu = lambda a: a / (1 + np.exp(-a))                                  # noqa: E731
    x64 = x.astype(np.float64)
    for t in range(tokens):
        for j in range(k):
            i = ids[t, j]
            h = silu(x64[t] @ wg[i]) * (x64[t] @ wu[i])
            want[t] += gates[t, j] * (h @ wd[i])
    scale = np.abs(x).max() * np.abs(wg).max() * e * np.abs(wd).max() * f * k * 4
    np.testing.assert_allclose(got, want, rtol=0, atol=sum_tol(e + f + k, scale))


def test_balance_loss_matches_the_switch_transformer_formula():
    rng = np.random.RandomState(1)
    n, k, tokens, layers = 6, 2, 10, 3
    weights = (rng.rand(tokens) > 0.3).astype(np.float32)
    sums, counts, probsum = 0, np.zeros(n), np.zeros(n)
    for _ in range(layers):
        logits = rng.randn(tokens, n).astype(np.float32)
        sums = sums + balance_sums(route(jnp.asarray(logits), k, True), jnp.asarray(weights))
        ids, _, p = _np_route(logits.astype(np.float64), k, True)
        for t in range(tokens):
            counts[ids[t]] += weights[t]
            probsum += weights[t] * p[t]
    rows = layers * weights.sum()
    want = n * np.sum((counts / rows) * (probsum / rows))   # Fedus et al. 2021, eq. 4-6
    got = float(balance_loss(sums, jnp.float32(rows)))
    np.testing.assert_allclose(got, want, rtol=sum_tol(layers * tokens + n), atol=0)
    assert float(balance_loss(jnp.zeros((2, n)), jnp.float32(0))) == 0.0


# ------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("k,norm", CASES)
def test_logits_and_greedy_text_match_transformers(moe_dir, k, norm):
    path = moe_dir(k, norm)
    model, cfg = load_hf(path)
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == \
        ("qwen3_moe", 16, k, norm)
    ref = _hf(path)
    width = 9
    toks = np.zeros((len(SEQS), width), np.int32)
    mask = np.zeros_like(toks, bool)
    for b, s in enumerate(SEQS):
        toks[b, width - len(s):], mask[b, width - len(s):] = s, True
    ours = np.asarray(_forward(model, jnp.asarray(toks), positions_from_mask(mask),
                               jnp.asarray(mask)))
    for b, s in enumerate(SEQS):
        want = _hf_logits(ref, s)
        assert np.abs(want).max() > 1.0
        np.testing.assert_allclose(ours[b, width - len(s):], want, rtol=0,
                                   atol=forward_atol(cfg, width, float(np.abs(want).max())),
                                   err_msg=f"k={k} norm={norm} row {b}")
    # greedy text: transformers' generate against rlflow's argmax, token by token, of the
    # same jitted forward (the [3, 9] batch above: causal, so right padding changes nothing;
    # the KV-cached sampler path is test_sampler_engine_greedy_matches_transformers's)
    steps, prompt = 6, SEQS[2]
    with torch.no_grad():
        hf_text = ref.generate(torch.tensor(prompt[None], dtype=torch.long), do_sample=False,
                               max_new_tokens=steps, pad_token_id=0)[0, len(prompt):].tolist()
    buf = np.zeros((len(SEQS), width), np.int32)
    buf[0, :len(prompt)] = prompt
    text = []
    for n in range(len(prompt), len(prompt) + steps):
        m = np.zeros_like(buf, bool)
        m[0, :n] = True
        logits = _forward(model, jnp.asarray(buf), positions_from_mask(m), jnp.asarray(m))
        buf[0, n] = int(jnp.argmax(logits[0, n - 1]))
        text.append(int(buf[0, n]))
    if len(hf_text) < steps:                # transformers stopped at an EOS id (2 or 3)
        assert hf_text[-1] in (2, 3)
        text = text[:len(hf_text)]
    assert text == hf_text


def test_sampler_engine_greedy_matches_transformers(moe_dir):
    """The sampler's engine (continuous batching, prefill buckets, KV cache decode) on a MoE
    model: the greedy tokens of transformers' ``generate`` for four prompts decoded together."""
    from rlflow.config import MeshConfig, SamplerConfig
    from rlflow.mesh import make_mesh
    from rlflow.sampler.batching import ContinuousBatcher, Request
    from rlflow.sampler.engine import RlflowEngine
    from rlflow.sampler.sampling import SamplingParams

    path = moe_dir(2, True)
    model, _ = load_hf(path)
    engine = RlflowEngine(model, SamplerConfig(num_slots=4, max_prefill_length=16,
                                               prefill_buckets=(8, 16), max_tokens=6,
                                               temperature=0.0),
                          mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    prompts = [[1, 17, 42], [1, 5, 9, 200, 31, 77, 4, 8, 100, 12, 6], [1], [9, 8, 7, 6, 5, 13]]
    groups = {g.prompt_id: g for g in ContinuousBatcher(engine).run(
        [Request(i, p, 1, SamplingParams(temperature=0.0, max_tokens=6))
         for i, p in enumerate(prompts)])}
    ref = _hf(path)
    for i, prompt in enumerate(prompts):
        ours = groups[i].completions[0].tokens.tolist()
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(
                1, len(prompt), dtype=torch.long), do_sample=False,
                max_new_tokens=6)[0, len(prompt):].tolist()
        assert ours == want[:len(ours)] and (len(ours) == 6 or ours[-1] in (2, 3)), (i, ours, want)


def test_export_loads_in_transformers_with_the_same_logits(moe_dir, tmp_path):
    src = moe_dir(2, True)
    model, cfg = load_hf(src)
    out = str(tmp_path / "export")
    save_hf(model, cfg, out)
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    assert c["architectures"] == ["Qwen3MoeForCausalLM"] and c["num_experts"] == 16
    assert c["mlp_only_layers"] == [] and c["decoder_sparse_step"] == 1
    # float32 weights copied bit for bit, run by the same program: the same logits
    for s in SEQS:
        np.testing.assert_array_equal(_hf_logits(_hf(out), s), _hf_logits(_hf(src), s))
    again, cfg2 = load_hf(out)
    assert cfg2 == cfg


# ------------------------------------------------------------------------------ config
def _moe_config(**over):
    d = DecoderConfig(model_type="qwen3_moe", qk_norm=True, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=8).to_hf_dict()
    d.update(over)
    return d


@pytest.mark.parametrize("field,value", [("mlp_only_layers", [1]), ("decoder_sparse_step", 2),
                                         ("shared_expert_intermediate_size", 64)])
def test_unsupported_moe_layouts_are_refused_naming_the_field(field, value):
    with pytest.raises(ModelFormatError, match=f"config.json: {field}"):
        DecoderConfig.from_hf_dict(_moe_config(**{field: value}))


def test_moe_config_reads_both_expert_count_names():
    d = _moe_config()
    assert DecoderConfig.from_hf_dict(d).num_experts == 4
    del d["num_experts"]
    assert DecoderConfig.from_hf_dict(d).num_experts == 4            # transformers 5.x name
    del d["num_local_experts"]
    with pytest.raises(ModelFormatError, match="num_experts"):
        DecoderConfig.from_hf_dict(d)
    with pytest.raises(ModelFormatError, match="num_experts_per_tok"):
        DecoderConfig(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5,
                      moe_intermediate_size=8)
    with pytest.raises(ModelFormatError, match="num_experts"):
        DecoderConfig(model_type="qwen3", num_experts=4)


def test_float32_tolerance_is_small():
    """The bound the parity test uses stays far below the logits' scale (not vacuous)."""
    cfg = DecoderConfig(model_type="qwen3_moe", qk_norm=True, vocab_size=256, hidden_size=32,
                        num_experts=16, num_experts_per_tok=8, moe_intermediate_size=16)
    assert forward_atol(cfg, 9, 3.0) < 1e-3 and F32_EPS < 1e-6


def test_fused_expert_checkpoints_load_the_same_parameters(moe_dir, tmp_path):
    """A checkpoint holding the experts fused as transformers 5.x holds them in memory
    (``experts.gate_up_proj [n, 2F, E]``, ``experts.down_proj [n, E, F]``) loads the same
    parameters as the per-expert files."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src = moe_dir(2, True)
    out = tmp_path / "fused"
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        take = lambda name: np.stack([tensors.pop(f"{p}{j}.{name}.weight")   # noqa: E731
                                      for j in range(16)])
        gate, up, down = take("gate_proj"), take("up_proj"), take("down_proj")
        tensors[p + "gate_up_proj"] = np.concatenate([gate, up], axis=1)
        tensors[p + "down_proj"] = down
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    # the layout is transformers' own: it loads the fused file to the same model (the same
    # weights; its kernels may differ in summation order with the tensors' memory layout)
    ref = _hf_logits(_hf(src), SEQS[0])
    np.testing.assert_allclose(_hf_logits(_hf(str(out)), SEQS[0]), ref, rtol=0,
                               atol=forward_atol(load_hf(src)[1], len(SEQS[0]),
                                                 float(np.abs(ref).max())))
    want = nnx.to_pure_dict(nnx.state(load_hf(src)[0], nnx.Param))
    got = nnx.to_pure_dict(nnx.state(load_hf(str(out))[0], nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 got, want)
    # a fused tensor of the wrong width is named with both shapes
    tensors["model.layers.1.mlp.experts.down_proj"] = down[:, :, :8]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"layers.1.mlp.experts.down_proj.*\[16, 32, 8\]"
                                               r".*\[16, 32, 16\]"):
        load_hf(str(out))
