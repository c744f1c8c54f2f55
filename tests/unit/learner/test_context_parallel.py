"""Context parallelism (issue 43 item 4): the ``sequence`` mesh axis. Attention with the
positions split over it equals the one-device attention (values and gradients, packed rows
with shared prompts and padding); the train step's loss, gradients, logprobs and KL on
sequence=4 and tensor x sequence meshes of fake CPU devices equal today's single-device step
(one module-scoped reference), and the learner's step on data x sequence equals the
single-device learner's (the data x sequence split is checked there only); the loss-position
groups follow the position spans; row lengths that do not split over the axis are refused
naming ``mesh.sequence``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlflow.config import (ConfigError, ExperimentConfig, LearnerConfig, MeshConfig,
                           RolloutCorrectionConfig,
                           ModelConfig, SamplerConfig)
from rlflow.learner import loss_positions
from rlflow.learner.batch import BatchSpec, TrainBatch, build_batch
from rlflow.learner.packing import PackSpec, pack_batch
from rlflow.learner.step import StepSettings, make_grad_fn, policy_logprobs
from rlflow.mesh import batch_sharding, make_mesh, param_shardings
from rlflow.models import attention as A
from rlflow.models import context_parallel
from rlflow.learner.trainer import Learner
from learner_fixtures import (assert_same_packed_step, assert_same_train_step,
                              make_group_records, model_and_reference, one_device_mesh,
                              tiny_experiment)
from tolerances import sum_tol

VOCAB, G, T = 64, 4, 6
MODEL = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)
SPEC = BatchSpec(group_size=G, num_rows=8, seq_buckets=(16,), max_tokens=T)
# sequence=2 alone is data=2 x sequence=2's layout within each data shard, and that mesh is
# test_learner_on_data_fsdp_sequence_mesh_equals_single_device_today's (the learner's jitted
# step is make_grad_fn on the mesh, checked there against the single-device learner)
MESHES = {"sequence4": MeshConfig(sequence=4),
          "tensor2_sequence2": MeshConfig(tensor=2, sequence=2)}


def mesh_of(cfg: MeshConfig):
    return make_mesh(cfg, jax.devices()[:cfg.num_devices])


# --------------------------------------------------------------------------- attention

def _row_inputs(seed, b=2, t=16, h=4, k=2, d=8):
    """Packed rows: 2 segments per row, the second attending the first as its shared prompt,
    row 0 left-padded 3 positions (padding in segment 0, a padding query has no key)."""
    rng = np.random.default_rng(seed)
    q, kk, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, k, k))
    valid = np.ones((b, t), bool)
    valid[0, :3] = False
    seg = np.where(np.arange(t) < t // 2, 1, 2)[None].repeat(b, 0).astype(np.int32)
    seg[~valid] = 0
    prefix = np.where(seg == 2, 1, seg).astype(np.int32)
    return q, kk, v, jnp.asarray(valid), jnp.asarray(seg), jnp.asarray(prefix)


@pytest.mark.parametrize("impl", ["blockwise", "xla"])
@pytest.mark.parametrize("sequence", [2, 4])
def test_sequence_split_attention_equals_one_device(impl, sequence, monkeypatch):
    """Queries local, keys and values all-gathered over the axis, global positions in the
    causal and segment masks: output and gradients (w.r.t. q, k, v) equal the one-device
    attention within the reordering of the D-long scores and T-long weighted sums
    (blockwise: blocks of 4, so local queries span several key blocks)."""
    monkeypatch.setattr(A, "BLOCK", 4)
    q, k, v, valid, seg, prefix = _row_inputs(0)
    mesh = mesh_of(MeshConfig(sequence=sequence))
    cos = jnp.cos(jnp.arange(q.size, dtype=jnp.float32).reshape(q.shape))

    def one(q, k, v):
        return A.attention(q, k, v, attention_mask=valid, segment_ids=seg, prefix_ids=prefix,
                           impl=impl)

    def split(q, k, v):
        return context_parallel.attention(q, k, v, mesh=mesh, attention_mask=valid,
                                          segment_ids=seg, prefix_ids=prefix, impl=impl)

    outs = {}
    for name, f in (("one", one), ("split", split)):
        fwd = jax.jit(f)(q, k, v)
        grads = jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cos), argnums=(0, 1, 2)))(
            q, k, v)
        outs[name] = (fwd, grads)
    n = q.shape[-1] + q.shape[1]                       # scores (D) and weighted sum (T)
    scale = float(jnp.abs(v).max())
    np.testing.assert_allclose(outs["split"][0], outs["one"][0], rtol=0,
                               atol=2 * sum_tol(n, scale))
    for a, b, name in zip(outs["split"][1], outs["one"][1], "qkv"):
        np.testing.assert_allclose(a, b, rtol=0, atol=4 * sum_tol(n, float(jnp.abs(b).max())
                                                                  + scale), err_msg=name)
    assert outs["one"][0].shape == q.shape and float(jnp.abs(outs["one"][1][1]).max()) > 0


def test_kernels_and_rows_that_do_not_split_are_refused():
    q, k, v, valid, seg, _ = _row_inputs(1, t=6)
    mesh = mesh_of(MeshConfig(sequence=4))
    with pytest.raises(ValueError, match=r"6 positions .* learner\.mesh\.sequence=4"):
        context_parallel.attention(q, k, v, mesh=mesh, attention_mask=valid)
    with pytest.raises(ValueError, match=r"learner\.attention='splash' .*sequence=2"):
        A.resolve("splash", prefix=False, sequence=2)
    assert A.resolve("auto", prefix=False, backend="tpu", sequence=2) == "blockwise"


# --------------------------------------------------------------------------- loss positions

def test_loss_position_groups_are_row_and_position_spans():
    """[B, T] = [4, 8] in 2 row groups x 2 position spans: group (s, c) holds rows
    2s..2s+1, positions 4c..4c+3, row-major (numpy oracle); gather / scatter round-trip; the
    host check names the span."""
    rng = np.random.default_rng(3)
    mask = rng.random((4, 8)) < 0.5
    x = rng.normal(size=(4, 8)).astype(np.float32)
    idx = np.asarray(loss_positions.loss_index(jnp.asarray(mask), 2, 8, seq_shards=2))
    gathered = np.asarray(loss_positions.gather(jnp.asarray(x), jnp.asarray(idx), 2))
    for s in range(2):
        for c in range(2):
            span_mask = mask[2 * s:2 * s + 2, 4 * c:4 * c + 4].reshape(-1)
            span_x = x[2 * s:2 * s + 2, 4 * c:4 * c + 4].reshape(-1)
            want = np.flatnonzero(span_mask)
            got = idx[2 * s + c]
            np.testing.assert_array_equal(got[:len(want)], want)
            assert np.all(got[len(want):] == 8)
            np.testing.assert_array_equal(gathered[2 * s + c, :len(want)], span_x[want])
    back = loss_positions.scatter(loss_positions.gather(jnp.asarray(x), jnp.asarray(idx), 2),
                                  jnp.asarray(idx), x.shape, 2)
    np.testing.assert_array_equal(np.asarray(back), np.where(mask, x, 0))
    assert loss_positions.capacity_for(4, 8, 2, 100, seq_shards=2) == 8
    full = np.zeros((4, 8), bool)
    full[2, 4:] = full[3, 4:] = True
    with pytest.raises(ValueError, match=r"row group 1, position span 1: 8 loss positions"):
        loss_positions.check_capacity(full, 1, 2, 7, seq_shards=2)


# --------------------------------------------------------------------------- train step

@pytest.fixture(scope="module")
def packed_case():
    """A packed batch with shared prompts (4-row multiple: 2 micro-batches x data 2), the
    tiny model and its KL reference, and today's single-device results ("xla" attention,
    one-pass logprobs, no remat): ``(loss, grads, stats)`` and the per-token logprobs."""
    graphdef, params, ref = model_and_reference(MODEL)
    recs = make_group_records(7, 2, vocab=VOCAB, group_size=G, max_tokens=T, noise=1.0)
    batch, _ = build_batch(recs, SPEC, 0)
    spec = PackSpec.create(num_rows=8, max_row=16, pack_length=16, buckets=2, split=4,
                           shared_prefix=True)
    packed, _ = pack_batch(batch, spec)
    assert packed.prefix_ids is not None and packed.tokens.shape[0] % 4 == 0
    jb = TrainBatch(*packed)
    s = settings("xla", 0, "none")
    today = jax.jit(make_grad_fn(graphdef, s))(params, jb, ref)
    lp = np.asarray(jax.jit(functools.partial(policy_logprobs, graphdef,
                                              attention="xla"))(params, jb)[0])
    return graphdef, params, ref, packed, today, lp


def settings(attention, chunk, remat):
    return StepSettings(loss_agg="seq-mean-token-mean", norm_len=T, micro_batches=2,
                        kl_coef=0.3, correction=RolloutCorrectionConfig(weight_cap=1.5),
                        max_loss_tokens=SPEC.num_rows * T,
                        attention=attention, logprob_chunk=chunk, remat=remat)


@pytest.mark.parametrize("name", list(MESHES))
def test_train_step_on_a_sequence_mesh_equals_single_device_today(packed_case, name):
    """Remat ("full"), blockwise attention ("auto" with a sequence axis), logprobs in chunks
    of 5 at the loss positions, on the mesh: loss, gradients, KL, entropy, IS statistics and
    the per-token logprobs equal today's one-device step (tolerances as
    test_attention_step.py: the reordering along the model's reduction chain)."""
    graphdef, params, ref, packed, (l0, g0, s0), lp0 = packed_case
    mesh = mesh_of(MESHES[name])
    psh = param_shardings(params, mesh)
    bsh = batch_sharding(mesh)
    jb = jax.device_put(TrainBatch(*packed), TrainBatch(*([bsh] * len(TrainBatch._fields))))
    p, r = jax.device_put(params, psh), jax.device_put(ref, psh)
    l1, g1, s1 = jax.jit(make_grad_fn(graphdef, settings("auto", 5, "full"), mesh))(p, jb, r)
    lp1 = jax.jit(functools.partial(policy_logprobs, graphdef, logprob_chunk=5,
                                    mesh=mesh))(p, jb)[0]
    assert_same_packed_step(MODEL, packed, (l0, g0, s0, lp0), (l1, g1, s1, lp1))


@pytest.mark.slow
def test_learner_on_data_fsdp_sequence_mesh_equals_single_device_today():
    """The default learner (packed rows of 28 with shared prompts, remat "full", "auto"
    attention, logprobs in chunks of 8 at the loss positions) on data=2 x sequence=2 fake
    devices with 2 micro-batches: its jitted step (batch positions split over the axis)
    equals the single-device learner on today's path ("xla", one-pass logprobs, no remat)
    after one step: metrics and updated parameters."""
    kw = dict(micro_batches=2, kl_coef=0.5, loss_agg="seq-mean-token-mean")
    recs = make_group_records(11, 2, vocab=VOCAB, group_size=G, max_tokens=T, noise=1.0)
    new = Learner(tiny_experiment(MODEL, G, T, num_devices=4,
                                  mesh=MeshConfig(data=2, sequence=2), logprob_chunk=8, **kw))
    today = Learner(tiny_experiment(MODEL, G, T, attention="xla", logprob_chunk=0,
                                    remat="none", **kw), mesh=one_device_mesh())
    mn, mt = new.train_on(recs), today.train_on(recs)
    assert_same_train_step(mn, mt, new.params, today.params, MODEL, rows=8, seq=16)


# --------------------------------------------------------------------------- config

def _experiment(mesh, **learner):
    lr = dict(groups_per_step=2, num_devices=mesh.num_devices, mesh=mesh) | learner
    return ExperimentConfig(sampler=SamplerConfig(max_prefill_length=8, prefill_buckets=(8,),
                                                  max_tokens=7),
                            learner=LearnerConfig(**lr))


def test_config_refuses_rows_that_do_not_split_and_a_sampler_sequence_axis():
    seq2 = MeshConfig(sequence=2)
    with pytest.raises(ConfigError, match=r"learner\.mesh\.sequence: is 2, .*"
                                          r"learner\.seq_buckets has \[15\]"):
        _experiment(seq2, packing=False, seq_buckets=(8, 15))
    with pytest.raises(ConfigError, match=r"learner\.mesh\.sequence: is 2, .*packed row "
                                          r"length .* \[15\]"):
        _experiment(seq2, shared_prefix=False)      # packed rows of 8 + 7 = 15
    with pytest.raises(ConfigError, match=r"learner\.mesh\.sequence: is 2, .*padded row "
                                          r"length .* \[15\]"):
        _experiment(seq2, packing=False)
    assert _experiment(seq2, pack_length=16).learner.mesh.sequence == 2
    assert _experiment(seq2, packing=False, seq_buckets=(8, 16)).learner.seq_buckets == (8, 16)
    with pytest.raises(ConfigError, match=r"learner\.attention: 'splash' .*sequence=2"):
        LearnerConfig(num_devices=2, mesh=seq2, attention="splash", shared_prefix=False)
    with pytest.raises(ConfigError, match=r"sampler\.mesh\.sequence: must be 1"):
        SamplerConfig(num_devices=2, mesh=seq2)
    assert MeshConfig(fsdp=2, sequence=2).num_devices == 4
    assert MeshConfig(fsdp=2, sequence=2).describe() == "data=1 x fsdp=2 x tensor=1 x sequence=2"
