"""sampler.quantization="int8": projection kernels quantized with qwix once per weight
version (rlflow.sampler.quantization).

Oracles: numpy's symmetric per-output-channel int8 quantization (absmax / 127.5, round
half to even), a full teacher-forced forward of the dequantized weights (the quantized policy),
the greedy-decision argument (a token can only change where the float policy's top-2
margin is within twice the logit perturbation), the memory model's byte count against the
engine's arrays, and the rollout correction's numpy oracle (tests/unit/learner/test_rollout_correction.py)
on a batch whose behaviour logprobs are the int8 policy's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

from rlflow.config import (ConfigError, ExperimentConfig, LearnerConfig, MeshConfig,
                           ModelConfig, RolloutCorrectionConfig as RC, SamplerConfig)
from rlflow.sampler.memory import sampler_bytes, sampler_weight_bytes
from rlflow.learner import losses
from rlflow.learner.batch import TrainBatch, build_batch, with_sequence_ids
from rlflow.learner.memory import Architecture
from rlflow.learner.step import StepSettings, make_grad_fn, policy_logprobs
from rlflow.mesh import make_mesh
from rlflow.models import build_model, load_hf, positions_from_mask
from rlflow.sampler import layer_storage, quantization
from rlflow.sampler.batching import ContinuousBatcher, Request
from rlflow.sampler.engine import RlflowEngine
from rlflow.sampler.sampling import SamplingParams
from learner_fixtures import make_group_records
from test_rollout_correction import MODEL as RC_MODEL, SPEC, T, VOCAB, G, np_correct
from tolerances import F32_EPS, forward_atol, model_chain_len, reorder_rtol

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [30, 31, 5, 90, 17]]


def np_int8(w, contract):
    """numpy oracle: (q int8, scale) with one scale per output channel: absmax over the
    input axes ``contract`` / 127.5 (qwix's int8 range [-127.5, 127.5]: the end buckets
    are whole; a zero channel's scale is 1), q = round(w / scale) half to even, saturated to
    [-128, 127]."""
    w = np.asarray(w, np.float32)
    scale = (np.max(np.abs(w), axis=contract, keepdims=True) / np.float32(127.5)).astype(
        np.float32)
    scale = np.where(scale < np.sqrt(np.finfo(np.float32).tiny), np.float32(1), scale)
    return np.clip(np.round(w / scale), -128, 127).astype(np.int8), scale


def view_state(model):
    """The engine's parameter tree: one leaf per layer (:mod:`rlflow.sampler.layer_storage`)."""
    return nnx.split(layer_storage.unstacked_view(model), nnx.Param)[1]


def engine_of(model, q="none", backend=None, **kw):
    """An engine on one CPU device; ``backend="tpu"``: its int8 kernels held as on an
    accelerator (int8 ``QArray`` s dequantized inside each call, not at the swap)."""
    base = dict(num_slots=4, max_prefill_length=16, prefill_buckets=(8, 16), max_tokens=8,
                temperature=0.0, quantization=q)
    base.update(kw)
    engine = RlflowEngine(model, SamplerConfig(**base), mesh=make_mesh(MeshConfig(),
                                                                       jax.devices()[:1]))
    if backend is not None:
        engine._quant = quantization.QuantizedKernels(view_state(model), q, backend)
    return engine


@pytest.fixture(scope="module")
def sharp_model():
    """A random tiny model (untied LM head, so it is quantized too) with logits sharpened
    x6 (a non-constant greedy path), and its float and int8 engines."""
    model = build_model(ModelConfig(hidden_size=64, num_layers=2, vocab_size=128,
                                    init_seed=3, tie_word_embeddings=False))[0]
    nnx.update(model, jax.tree_util.tree_map(lambda x: x * 6.0, nnx.state(model, nnx.Param)))
    return model, engine_of(model), engine_of(model, "int8")


_FORWARDS = {}


def teacher_logits(model, state, seq):
    """float32 logits ``[len(seq), V]`` of one sequence under ``state`` (full forward)."""
    if id(model) not in _FORWARDS:
        graphdef, _ = nnx.split(model, nnx.Param)
        _FORWARDS[id(model)] = (model, jax.jit(lambda st, t, pos, mask: nnx.merge(
            graphdef, st)(t, pos, mask)))
    forward = _FORWARDS[id(model)][1]
    n = len(seq)                     # right-padded to 32: one compile (causal: same logits)
    tokens = jnp.asarray([list(seq) + [0] * (32 - n)], jnp.int32)
    mask = jnp.arange(32)[None] < n
    logits = forward(state, tokens, positions_from_mask(mask), mask)[0, :n]
    return np.asarray(logits, np.float64)


# --------------------------------------------------------------------------- config

def test_quantization_field_is_checked_and_named():
    with pytest.raises(ConfigError, match="sampler.quantization"):
        SamplerConfig(quantization="int4")
    assert SamplerConfig().quantization == "none"
    with pytest.raises(ValueError, match="sampler.quantization"):
        quantization.QuantizedKernels({}, "fp8")


def test_rollout_correction_is_on_with_int8_unless_set_off():
    on = ExperimentConfig(sampler=SamplerConfig(quantization="int8"))
    assert on.learner.rollout_correction.enabled
    assert on.learner.rollout_correction.weight == "token"
    off = ExperimentConfig(sampler=SamplerConfig(quantization="int8"),
                           learner=LearnerConfig(rollout_correction=RC(weight="off")))
    assert not off.learner.rollout_correction.enabled           # the explicit setting wins


def test_input_axes_cover_stacked_and_attention_output_kernels():
    assert quantization.input_axes(("embed", "mlp"), 2) == (0,)
    assert quantization.input_axes(("mlp", "embed"), 2) == (0,)
    assert quantization.input_axes(("embed", "q_heads", "head_dim"), 3) == (0,)
    assert quantization.input_axes(("q_heads", "head_dim", "embed"), 3) == (0, 1)
    # a stacked [L, ...] layout: the layer axis is channelwise (one scale per layer)
    assert quantization.input_axes(("layers", "embed", "mlp"), 3) == (1,)
    assert quantization.input_axes(("layers", "q_heads", "head_dim", "embed"), 4) == (1, 2)
    assert quantization.input_axes(None, 2) == (0,)


# --------------------------------------------------------------------------- the swap

def test_kernels_are_quantized_per_output_channel_and_remade_every_version(sharp_model):
    """The int8 values and scales qwix makes at a swap (held as QArrays on an accelerator)
    against the numpy oracle; the CPU engine holds exactly their dequantized values; a new
    version is quantized anew, the same arrays again are not."""
    model, _, engine = sharp_model
    accel = engine_of(model, "int8", backend="tpu")
    plain = nnx.state(model, nnx.Param)
    view = view_state(model)          # the engine holds the layers one leaf per layer
    flat = jax.tree_util.tree_flatten_with_path(view)[0]
    names = [jax.tree_util.keystr(p) for p, _ in flat]
    kernels = dict(quantization.projection_kernels(view))
    quantized = {n for i, n in enumerate(names) if i in kernels}
    # every projection kernel and the untied LM head; not the embedding, norms
    assert sum("_kernel" in n for n in names) == len(quantized) - 1
    assert any("lm_head" in n for n in quantized)
    assert not any("embed" in n or "norm" in n for n in quantized)

    def check(state, version):
        leaves = accel._layers.view_leaves(jax.tree_util.tree_leaves(state))
        held = accel._kernels.model_leaves(accel.load_params(state, version).leaves)
        on_cpu = engine._kernels.model_leaves(engine.load_params(state, version).leaves)
        for i, x in enumerate(held):
            if i not in kernels:
                assert not isinstance(x, qwix.QArray)
                continue
            contract = tuple(a for a in range(x.ndim) if a not in kernels[i])
            q, scale = np_int8(leaves[i], contract)
            assert x.qvalue.dtype == jnp.int8, names[i]
            # the scale: one division, which XLA may do as a product with the reciprocal
            # (two roundings)
            np.testing.assert_allclose(np.asarray(x.scale), scale, rtol=2 * F32_EPS, atol=0,
                                       err_msg=names[i])
            # the values: equal, except at a rounding tie (w / scale within a few ulps of
            # k + 1/2, e.g. the channel's absmax at 127.5), where either neighbour is right
            r = np.asarray(leaves[i], np.float32) / scale
            tie = np.abs(np.abs(r - np.trunc(r)) - 0.5) <= 4 * F32_EPS * 128
            got = np.asarray(x.qvalue).astype(np.int32)
            np.testing.assert_array_equal(got[~tie], q[~tie], err_msg=names[i])
            assert np.all(np.abs(got[tie] - q[tie]) <= 1), names[i]
            scale = np.asarray(x.scale)
            # the dequantized weight is within half a step of the weight (plus the
            # roundings of the scale and of q * scale, |q| <= 128: 2 + 1 eps relative)
            deq = np.asarray(qwix.dequantize(x))
            bound = scale * (0.5 + 3 * 128 * F32_EPS)
            assert np.all(np.abs(deq.astype(np.float64) - leaves[i]) <= bound), names[i]
            # the CPU engine holds those dequantized values (same jitted quantization)
            assert not isinstance(on_cpu[i], qwix.QArray)
            np.testing.assert_array_equal(np.asarray(on_cpu[i]), deq, err_msg=names[i])
        return held

    first = check(plain, 1)
    # the next version (other values, not a rescaling) is quantized anew ...
    noise = jax.tree.map(lambda x: x * (1 + 0.05 * jax.random.normal(
        jax.random.key(1), x.shape, x.dtype)), plain)
    second = check(noise, 2)
    changed = [not np.array_equal(np.asarray(first[i].qvalue), np.asarray(second[i].qvalue))
               for i in kernels]
    assert all(changed)
    # ... and the same arrays again (a LoRA forward swap passes its base): kept, not redone
    for e in (engine, accel):
        kept = [e._quant._kept[i][1] for i in kernels]
        e.load_params(noise, version=3)
        assert all(a is b for a, b in zip(kept, [e._quant._kept[i][1] for i in kernels]))


def test_memory_model_counts_int8_kernels_and_scales():
    """sampler_weight_bytes equals the bytes an engine holds (tied and untied LM head):
    int8 values and scales on an accelerator, the dequantized float kernels on the CPU
    backend (which the CPU memory check counts)."""
    for tie in (False, True):
        cfg = ModelConfig(hidden_size=64, num_layers=2, vocab_size=128, init_seed=3,
                          tie_word_embeddings=tie)
        model = build_model(cfg)[0]
        arch = Architecture.from_model_config(cfg)
        float32, accel, cpu = (quantization.kernel_bytes(engine_of(model, q, b).load_params(
        ).leaves) for q, b in (("none", None), ("int8", "tpu"), ("int8", None)))
        assert float32 == sampler_weight_bytes(arch, 4), tie
        assert accel == sampler_weight_bytes(arch, 4, "int8") < float32, tie
        assert cpu == float32, tie
    exp = ExperimentConfig(sampler=SamplerConfig(quantization="int8"))
    full = ExperimentConfig()
    arch = Architecture.from_model_config(exp.model)
    saved = sampler_bytes(full, arch) - sampler_bytes(exp, arch)
    assert saved == sampler_weight_bytes(arch, 4) - sampler_weight_bytes(arch, 4, "int8") > 0
    assert sampler_bytes(exp, arch, accelerator=False) == sampler_bytes(full, arch)


# --------------------------------------------------------------------------- decoding

def test_behaviour_logprobs_are_the_quantized_policy_s(sharp_model):
    """Sampled tokens' logprobs from the int8 engine equal a full forward of the dequantized
    weights (engine.param_state) and differ from the float policy's by more than rounding;
    the accelerator path (int8 kernels dequantized inside each call) samples the same."""
    model, _, engine = sharp_model
    deq = engine.param_state(engine.load_params())
    reqs = [Request(i, p, 2, SamplingParams(temperature=1.0, max_tokens=8, seed=7 + i))
            for i, p in enumerate(PROMPTS[:2])]
    groups = ContinuousBatcher(engine).run(reqs)
    accel = {g.prompt_id: g for g in ContinuousBatcher(
        engine_of(model, "int8", backend="tpu")).run(reqs)}
    gap = []
    for g in groups:
        for c, a in zip(g.completions, accel[g.prompt_id].completions):
            assert c.tokens.tolist() == a.tokens.tolist()
            np.testing.assert_allclose(a.logprobs, c.logprobs, rtol=0, atol=forward_atol(
                model.cfg, 24, float(np.abs(c.logprobs).max())))
            seq = list(g.request.prompt_tokens) + c.tokens.tolist()
            p, n = len(g.request.prompt_tokens), len(c.tokens)
            for state, out in ((deq, None), (nnx.state(model, nnx.Param), gap)):
                logits = teacher_logits(model, state, seq)[p - 1:p - 1 + n]
                lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(
                    -1, keepdims=True)) - logits.max(-1, keepdims=True)
                ref = np.take_along_axis(lp, c.tokens[:, None], -1)[:, 0]
                tol = forward_atol(model.cfg, len(seq), float(np.abs(logits).max()))
                if out is None:
                    np.testing.assert_allclose(c.logprobs, ref, rtol=0, atol=tol)
                else:
                    out.append(float(np.abs(c.logprobs - ref).max()) > tol)
    assert any(gap)                  # int8 is another policy than the float one


def test_greedy_tokens_change_only_where_the_float_margin_is_within_the_perturbation(
        gsm8k_model):
    """The GSM8K test model (tests/conftest.py ``gsm8k_model``: a tiny random Qwen2 with a
    BPE vocabulary trained on GSM8K questions), greedy, int8 vs
    float32. With the same prefix the int8 model picks the float model's token wherever the
    float top-2 margin exceeds twice the largest logit change ``|l_q - l_f|_inf`` (teacher
    forcing both) plus rounding. So each int8 completion equals the float one at least up
    to the first such near-tie, every safe position of the float path keeps its token, and
    most positions are safe ("mostly match", by the bound)."""
    path, vocab = gsm8k_model
    model = load_hf(path)[0]
    float_engine, int8_engine = engine_of(model), engine_of(model, "int8")
    prompts = [[p % vocab for p in pr] for pr in ([1, 2, 3], [400, 5, 1600, 7, 8, 9, 10],
                                                 [11], [30, 31, 5, 900, 17])]
    reqs = [Request(i, p, 1, SamplingParams(temperature=0.0, max_tokens=8))
            for i, p in enumerate(prompts)]
    ref = {g.prompt_id: g.completions[0].tokens for g in ContinuousBatcher(float_engine).run(reqs)}
    got = {g.prompt_id: g.completions[0].tokens for g in ContinuousBatcher(int8_engine).run(reqs)}
    deq = int8_engine.param_state(int8_engine.load_params())
    assert len({tuple(t) for t in ref.values()}) > 1
    safe_count = total = 0
    for pid, f in ref.items():
        seq = prompts[pid] + f.tolist()
        p = len(prompts[pid])
        lf = teacher_logits(model, nnx.state(model, nnx.Param), seq)[p - 1:p - 1 + len(f)]
        lq = teacher_logits(model, deq, seq)[p - 1:p - 1 + len(f)]
        tol = 2 * forward_atol(model.cfg, len(seq), float(np.abs(lf).max()))
        top2 = np.sort(lf, -1)[:, -2:]
        safe = top2[:, 1] - top2[:, 0] > 2 * np.abs(lf - lq).max(-1) + tol
        assert (lf.argmax(-1) == f).all()                  # the float path is greedy
        assert (lq.argmax(-1) == f)[safe].all(), pid      # safe positions keep their token
        n_safe = int(np.argmin(safe)) if not safe.all() else len(f)
        q = got[pid]
        n_same = next((t for t in range(min(len(f), len(q))) if f[t] != q[t]),
                      min(len(f), len(q)))
        assert n_same >= n_safe, (pid, f, q, safe)
        safe_count, total = safe_count + int(safe.sum()), total + len(f)
    assert safe_count > total / 2, (safe_count, total)


# --------------------------------------------------------------------------- the learner

def test_step_loss_with_int8_behaviour_logprobs_equals_corrected_objective():
    """A batch whose behaviour logprobs are those of the int8-quantized policy (the learner
    holds the float one): the step's loss with the default correction (token-level
    truncated IS, cap 2, decoupled PPO) equals the numpy oracle of the corrected objective,
    and the correction moves the loss by more than the comparison's tolerance."""
    model = build_model(RC_MODEL)[0]          # logits sharpened x4: log-ratios well above
    nnx.update(model, jax.tree_util.tree_map(   # the comparison's rounding bound
        lambda x: x * 4.0, nnx.state(model, nnx.Param)))
    graphdef, params = nnx.split(model, nnx.Param)
    int8 = engine_of(model, "int8", max_prefill_length=8, prefill_buckets=(8,),
                     max_tokens=T)
    qparams = int8.param_state(int8.load_params())
    recs = (make_group_records(0, 1, vocab=VOCAB, group_size=G, max_tokens=T, version=1)
            + make_group_records(1, 1, vocab=VOCAB, group_size=G, max_tokens=T, version=1))
    batch = with_sequence_ids(build_batch(recs, SPEC, 1)[0])
    logp = {name: np.asarray(jax.jit(lambda st, b: policy_logprobs(graphdef, st, b)[0])(
        st, TrainBatch(*batch))) for name, st in (("float", params), ("int8", qparams))}
    mu = np.where(batch.loss_mask, logp["int8"], 0.0).astype(np.float32)
    batch = batch._replace(behaviour_logprobs=mu)
    mask, seg, grp = batch.loss_mask, batch.segment_ids, batch.group_ids
    agg = np.asarray(losses.loss_weights(mask, "seq-mean-token-mean", segment_ids=seg))
    adv = batch.advantages.astype(np.float64)
    chain, n = model_chain_len(RC_MODEL, batch.tokens.shape[1]), int(mask.sum())
    lr = np.where(mask, logp["float"] - mu, 0.0)
    assert np.abs(lr).max() > 0                       # the int8 policy differs
    for cfg in (RC(),):
        s = StepSettings(loss_agg="seq-mean-token-mean", norm_len=T, correction=cfg)
        loss, _, _ = jax.jit(make_grad_fn(graphdef, s))(params, TrainBatch(*batch), None)
        w, keep, _, _ = np_correct(lr, mask, seg, grp, cfg)
        want = float(np.sum(np.where(keep, agg * w * -adv, 0.0)))
        plain = float(np.sum(np.where(mask, agg * -adv, 0.0)))
        scale = float(np.sum(np.where(keep, np.abs(agg * w * adv), 0.0)))
        tol = reorder_rtol(chain, n) * scale
        np.testing.assert_allclose(float(loss), want, rtol=0, atol=tol)
        assert abs(want - plain) > 2 * tol, (cfg, want, plain, tol)
