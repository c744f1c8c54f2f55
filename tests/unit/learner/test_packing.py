"""Sequence packing: the packed layout against a numpy oracle built from the records, segment
loss weights against a numpy oracle, and the packed step equal to the unpacked one (loss,
gradients, logprobs, KL) in every aggregation mode, with micro-batches, on a sharded mesh and
with LoRA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlflow.config import (ConfigError, LearnerConfig, LoraConfig, MeshConfig, ModelConfig,
                           RolloutCorrectionConfig)
from rlflow.learner import loss_positions, losses
from rlflow.learner.batch import BatchError, BatchSpec, TrainBatch, build_batch
from rlflow.learner.packing import PackSpec, first_fit, pack_batch, pack_spec_from_config
from rlflow.learner.step import StepSettings, make_grad_fn, policy_logprobs
from rlflow.learner.trainer import Learner
from rlflow.models.hf import build_model
from learner_fixtures import (assert_same_train_step, flat, make_group_records,
                              model_and_reference, one_device_mesh, tiny_experiment)
from tolerances import (F32_EPS, MIXED_SIGN_CANCEL, forward_atol, model_chain_len,
                        reorder_rtol, sum_tol)

VOCAB, G, T = 64, 4, 6
MODEL = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)
SPEC = BatchSpec(group_size=G, num_rows=8, seq_buckets=(16,), max_tokens=T)
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def records(seed, n_groups=2):
    return make_group_records(seed, n_groups, vocab=VOCAB, group_size=G, max_tokens=T, noise=1.0)


def pack_spec(split=1, length=16, shared=False):
    return PackSpec.create(num_rows=8, max_row=16, pack_length=length, buckets=4, split=split,
                           shared_prefix=shared)


# --------------------------------------------------------------------------- host layout

def test_packed_layout_equals_numpy_oracle_from_the_records():
    """Every kept sample is one segment: its prompt + completion, positions 0..n-1, loss on
    its completion targets, its behaviour logprobs and group advantage; samples without loss
    tokens (masked truncated) are left out; padding fractions as counted from the lengths."""
    recs = records(3)
    recs[1]["truncated"][:] = [True, False, False, False]
    batch, _ = build_batch(recs, SPEC.replace(mask_truncated=True), 0)
    packed, info = pack_batch(batch, pack_spec(length=32))
    seg = packed.segment_ids
    total = 0
    for i, rec in enumerate(recs):
        r = np.asarray(rec["rewards"], np.float64)
        adv = (r - r.mean()) / (r.std(ddof=1) + 1e-6)       # GRPO: unbiased group std
        for s in range(G):
            row = i * G + s
            n, prompt = int(rec["completion_lengths"][s]), rec["prompt_tokens"]
            at = seg == row + 1
            if rec["truncated"][s]:
                assert not at.any()                     # no loss token: left out
                continue
            total += len(prompt) + n
            r_, = set(np.nonzero(at)[0])                # one packed row holds the segment
            want = np.concatenate([prompt, rec["completion_tokens"][s, :n]])
            np.testing.assert_array_equal(packed.tokens[at], want)
            np.testing.assert_array_equal(packed.targets[at][:-1], want[1:])
            np.testing.assert_array_equal(packed.positions[at], np.arange(len(want)))
            loss = np.zeros(len(want), bool)
            loss[len(prompt) - 1:len(prompt) - 1 + n] = True
            np.testing.assert_array_equal(packed.loss_mask[at], loss)
            np.testing.assert_array_equal(packed.behaviour_logprobs[at][loss],
                                          rec["behaviour_logprobs"][s, :n])
            np.testing.assert_allclose(packed.advantages[at][loss], adv[s], rtol=1e-5)
            assert np.all(packed.attention_mask[at])
    assert packed.attention_mask.sum() == total and not packed.attention_mask[seg == 0].any()
    assert info["batch/packed_samples"] == 7
    rows, lp = packed.tokens.shape
    assert lp == 32 and rows in pack_spec(length=32).row_counts
    assert info["learner/packed_padding_fraction"] == pytest.approx(1 - total / (rows * lp))
    real = sum(len(r["prompt_tokens"]) + int(n) for r in recs for n in r["completion_lengths"])
    assert info["learner/padding_fraction"] == pytest.approx(1 - (real + 0) / (8 * 16))


def test_first_fit_and_row_counts():
    assert first_fit([5, 9, 3, 7], 10) == [[1], [3, 2], [0]]
    spec = PackSpec.create(num_rows=16, max_row=192, pack_length=192, buckets=4, split=2)
    assert spec.row_counts == (4, 8, 12, 16) and spec.rows_for(5) == 8
    spec = PackSpec.create(num_rows=16, max_row=100, pack_length=400, buckets=4, split=1)
    assert spec.row_counts == (1, 2, 3, 4)           # 4 rows of 100 fit in one of 400


def test_used_row_counts_are_reused_else_the_worst_case():
    """The first step's rows round up to a bucket; a later step takes the smallest count an
    earlier step used that holds its rows (padding rows are empty: no loss token, no
    segment), else the worst case, so a run has at most two packed shapes; counts outside
    the spec's are ignored; more rows than the worst case is a BatchError."""
    spec = PackSpec.create(num_rows=16, max_row=192, pack_length=192, buckets=4, split=2)
    assert spec.row_counts == (4, 8, 12, 16)
    assert spec.rows_for(5) == 8                               # first step: its bucket
    assert spec.rows_for(5, used=[12, 16]) == 12
    assert spec.rows_for(3, used=[4, 16]) == 4
    assert spec.rows_for(5, used=[4]) == 16                    # none fits: the worst case
    assert spec.rows_for(5, used=[10]) == 8                    # 10 is not a row count
    with pytest.raises(BatchError, match="17 packed rows needed, more than the 16"):
        spec.rows_for(17, used=[16])
    recs = records(3)
    batch, _ = build_batch(recs, SPEC, 0)
    fresh, _ = pack_batch(batch, pack_spec(length=32))
    n = fresh.tokens.shape[0]
    bigger = max(pack_spec(length=32).row_counts)
    assert n < bigger                                       # the case under test exists
    reused, info = pack_batch(batch, pack_spec(length=32), used=[bigger])
    assert reused.tokens.shape == (bigger, 32) and info["batch/packed_rows"] == bigger
    for name in ("tokens", "targets", "positions", "segment_ids", "loss_mask",
                 "attention_mask", "behaviour_logprobs", "advantages"):
        np.testing.assert_array_equal(getattr(reused, name)[:n], getattr(fresh, name)[:n])
    assert not reused.attention_mask[n:].any() and not reused.loss_mask[n:].any()
    assert not reused.segment_ids[n:].any()


def test_too_long_rows_are_named_errors():
    with pytest.raises(ConfigError, match=r"learner\.pack_length: must hold the longest row "
                                          r"\(14 tokens"):
        tiny_experiment(MODEL, G, T, pack_length=12)
    with pytest.raises(ConfigError, match=r"learner\.packing: must be None or False"):
        LearnerConfig(advantage="gae", packing=True)
    assert pack_spec_from_config(tiny_experiment(MODEL, G, T, advantage="gae")) is None
    batch, _ = build_batch(records(0), SPEC, 0)
    with pytest.raises(BatchError, match="more than learner.pack_length 8"):
        pack_batch(batch, PackSpec(pack_length=8, row_counts=(8,)))


def test_segment_loss_weights_equal_numpy_oracle():
    """Per-sequence aggregations count segments: a numpy oracle over random packed rows."""
    rng = np.random.default_rng(0)
    seg = np.sort(rng.integers(0, 4, size=(3, 12)), axis=1) + np.array([[0], [10], [20]])
    seg = np.where(seg % 10 == 0, 0, seg)                          # some padding (id 0)
    mask = (rng.random(seg.shape) < 0.6) & (seg > 0)
    ids = [i for i in np.unique(seg) if i > 0 and mask[seg == i].any()]
    for mode in MODES:
        want = np.zeros(seg.shape)
        for i in ids:
            n_i = mask[seg == i].sum()
            want[(seg == i) & mask] = {"token-mean": 1 / mask.sum(),
                                       "seq-mean-token-mean": 1 / (n_i * len(ids)),
                                       "seq-mean-token-sum-norm": 1 / (T * len(ids))}[mode]
        got = losses.loss_weights(mask, mode, norm_len=T, segment_ids=seg)
        np.testing.assert_allclose(got, want, rtol=2 * F32_EPS, err_msg=mode)


# -------------------------------------------------------------------- the step, unpacked = packed

def test_shared_prefix_layout_equals_numpy_oracle():
    """With shared prompts each group's prompt (all but its last token) is packed once as a
    segment without loss; each kept sample's segment continues it at the positions it had
    alone, from its own copy of the last prompt token: prompt segment + sample segment are
    exactly the sample's tokens, positions and loss mask; samples without loss are left out;
    a lone kept sample of a group keeps its whole prompt (nothing to share)."""
    recs = records(3, n_groups=2)
    recs[1]["truncated"][:] = [True, True, True, False]      # group 1: one sample kept
    batch, _ = build_batch(recs, SPEC.replace(mask_truncated=True), 0)
    packed, info = pack_batch(batch, pack_spec(length=32, shared=True))
    seg, pre = packed.segment_ids, packed.prefix_ids
    total = 0
    for i, rec in enumerate(recs):
        prompt = rec["prompt_tokens"]
        kept = [s for s in range(G) if not rec["truncated"][s]]
        shared = len(kept) > 1
        total += (len(prompt) - 1) * shared
        for s in range(G):
            row = i * G + s
            at = seg == row + 1
            if s not in kept:
                assert not at.any()
                continue
            n = int(rec["completion_lengths"][s])
            want = np.concatenate([prompt, rec["completion_tokens"][s, :n]])
            r_, = set(np.nonzero(at)[0])                      # one packed row
            prefix_id, = set(pre[at])
            head = (seg[r_] == prefix_id) & (prefix_id != row + 1)
            assert head.sum() == (len(prompt) - 1 if shared else 0)
            assert not packed.loss_mask[r_][head].any()
            assert (pre[r_][head] == prefix_id).all()
            seen = head | (seg[r_] == row + 1)                # all this sample attends
            np.testing.assert_array_equal(packed.tokens[r_][seen], want)
            np.testing.assert_array_equal(packed.positions[r_][seen], np.arange(len(want)))
            loss = np.zeros(len(want), bool)
            loss[len(prompt) - 1:len(prompt) - 1 + n] = True
            np.testing.assert_array_equal(packed.loss_mask[r_][seen], loss)
            np.testing.assert_array_equal(packed.behaviour_logprobs[r_][seen][loss],
                                          rec["behaviour_logprobs"][s, :n])
            total += len(want) - (len(prompt) - 1) * shared
    assert packed.attention_mask.sum() == total
    assert not packed.attention_mask[seg == 0].any() and (pre[seg == 0] == 0).all()
    assert info["batch/packed_samples"] == G + 1


def test_decoder_shared_prefix_attention_equals_separate_sequences():
    """Two continuations of one prompt in one row, the prompt once (``prefix_ids``): each
    continuation's logits equal those of prompt + continuation run alone."""
    model, _ = build_model(MODEL)
    rng = np.random.default_rng(4)
    prompt, a, b = (rng.integers(1, VOCAB, size=k).astype(np.int32) for k in (5, 3, 4))
    tokens = np.concatenate([prompt[:-1], prompt[-1:], a, prompt[-1:], b])[None]
    seg = np.array([[9] * 4 + [1] * 4 + [2] * 5], np.int32)
    pre = np.full_like(seg, 9)
    pos = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7, 8]], np.int32)
    got = np.asarray(model(jnp.asarray(tokens), jnp.asarray(pos), jnp.ones_like(seg, bool),
                           segment_ids=jnp.asarray(seg), prefix_ids=jnp.asarray(pre)))
    for cont, at in ((a, seg[0] == 1), (b, seg[0] == 2)):
        alone = np.concatenate([prompt, cont])[None]
        want = np.asarray(model(jnp.asarray(alone), jnp.arange(alone.shape[1])[None],
                                jnp.ones(alone.shape, bool)))
        scale = float(np.abs(want).max()) + 1.0
        np.testing.assert_allclose(got[0][at], want[0][len(prompt) - 1:],
                                   atol=forward_atol(MODEL, alone.shape[1], scale))
    alone = prompt[None]
    want = np.asarray(model(jnp.asarray(alone), jnp.arange(5)[None], jnp.ones((1, 5), bool)))
    np.testing.assert_allclose(got[0][:4], want[0][:4],
                               atol=forward_atol(MODEL, 5, float(np.abs(want).max()) + 1.0))


@pytest.fixture(scope="module")
def tiny_model():
    return model_and_reference(MODEL)


def _k3(d):
    return np.expm1(d) - d


@pytest.mark.parametrize("mode,shared", [(m, True) for m in MODES] +
                         [("seq-mean-token-mean", False)])
def test_packed_step_equals_unpacked_and_numpy_oracle(tiny_model, mode, shared):
    """Logprobs per token, loss, KL and gradients of the packed batch (2 micro-batches; with
    ``shared``, each group's prompt packed once) equal the unpacked batch's (1 micro-batch);
    the loss equals a float64 numpy oracle built from the unpacked logprobs (ratio 1 at step
    start, truncated IS weight, k3 KL)."""
    graphdef, params, ref = tiny_model
    batch, _ = build_batch(records(7), SPEC, 0)
    packed, _ = pack_batch(batch, pack_spec(split=2, shared=shared))
    assert (packed.prefix_ids is not None) == shared
    kl_coef, cap = 0.3, 1.5
    out = {}
    for name, b, k in (("unpacked", batch, 1), ("packed", packed, 2)):
        s = StepSettings(loss_agg=mode, norm_len=T, micro_batches=k, kl_coef=kl_coef,
                         correction=RolloutCorrectionConfig(weight_cap=cap))
        jb = TrainBatch(*b)
        out[name] = jax.jit(make_grad_fn(graphdef, s))(params, jb, ref) + (
            np.asarray(policy_logprobs(graphdef, params, jb)[0]),
            np.asarray(policy_logprobs(graphdef, ref, jb)[0]))
    (lu, gu, su, lpu, refu), (lp_, gp, sp, lpp, refp) = out["unpacked"], out["packed"]
    # tolerances (tests/tolerances.py): each logprob is a forward chain of reductions, computed
    # by two programs (other row lengths, other kernels): 2 chain eps relative to |logit|
    # scale; sums over the n positions add n eps relative to their absolute terms.
    seq = max(batch.tokens.shape[1], packed.tokens.shape[1])
    chain, n = model_chain_len(MODEL, seq), batch.tokens.size
    lp_tol = 2 * chain * F32_EPS * (np.abs(lpu[batch.loss_mask]).max() + 1)
    ref_tol = 2 * chain * F32_EPS * (np.abs(refu[batch.loss_mask]).max() + 1)
    for r in range(batch.tokens.shape[0]):
        at = packed.segment_ids == r + 1
        if not at.any():
            continue
        row = batch.attention_mask[r]
        # the sample's own positions (shared: from its last prompt token on), at the offsets
        # they had alone; its last position's target lies past the sample
        np.testing.assert_allclose(lpp[at][:-1], lpu[r][row][packed.positions[at]][:-1],
                                   atol=lp_tol)
        # and the reference policy's (the KL term's), same tolerance by its own scale
        np.testing.assert_allclose(refp[at][:-1], refu[r][row][packed.positions[at]][:-1],
                                   atol=ref_tol)
    # numpy oracle of the loss from the unpacked logprobs
    m = batch.loss_mask
    lp64, mu, adv = lpu.astype(np.float64), batch.behaviour_logprobs, batch.advantages
    w_is = np.minimum(np.exp(lp64 - mu), cap)
    kl = np.where(m, _k3(refu.astype(np.float64) - lp64), 0.0)
    n_b = m.sum(1, keepdims=True)
    s_n = (n_b > 0).sum()
    w = {"token-mean": m / m.sum(), "seq-mean-token-mean": m / (np.maximum(n_b, 1) * s_n),
         "seq-mean-token-sum-norm": m / (T * s_n)}[mode]
    oracle = np.sum(w * (-adv * w_is + kl_coef * kl))
    scale = np.sum(w * (np.abs(adv) * w_is + kl_coef * np.abs(kl)))
    tol = (reorder_rtol(chain, n) + sum_tol(n)) * scale * MIXED_SIGN_CANCEL
    assert abs(float(lu) - oracle) <= tol and abs(float(lp_) - oracle) <= tol
    kl_atol = 2 * F32_EPS * float(m.sum())
    np.testing.assert_allclose(float(sp["kl"]), float(su["kl"]),
                               rtol=reorder_rtol(chain, n), atol=kl_atol)
    np.testing.assert_allclose(float(sp["kl"]), kl.sum(), rtol=reorder_rtol(chain, n),
                               atol=kl_atol)
    assert float(su["kl"]) > 0
    for key in ("entropy", "is_weight", "is_kept"):
        np.testing.assert_allclose(float(sp[key]), float(su[key]), rtol=reorder_rtol(chain, n),
                                   err_msg=key)
    cancel = scale / abs(oracle)
    fu, fp = flat(gu), flat(gp)
    for key in fu:
        err = np.linalg.norm(fp[key] - fu[key]) / np.linalg.norm(fu[key])
        assert err <= (2 * reorder_rtol(chain, n) + sum_tol(n)) * cancel, (key, err)


# ------------------------------------------------- logits only at loss positions (issue 15)

def test_loss_index_gather_scatter_equal_numpy_oracle():
    """Per row group (shard), slot j holds the j-th loss position in row-major order; unused
    slots hold the out-of-range index; gather reads those positions, scatter puts values back
    and leaves zeros elsewhere; the host check names an overfull group."""
    rng = np.random.default_rng(1)
    mask = rng.random((4, 6)) < 0.4
    mask[2:] = False
    mask[3, 5] = True                                   # group 1: a single loss position
    shards, cap = 2, 8
    idx = np.asarray(loss_positions.loss_index(jnp.asarray(mask), shards, cap))
    x = rng.normal(size=(4, 6, 3)).astype(np.float32)
    got = np.asarray(loss_positions.gather(jnp.asarray(x), jnp.asarray(idx)))
    back = np.asarray(loss_positions.scatter(jnp.asarray(got[..., 0]), jnp.asarray(idx),
                                             mask.shape))
    for g in range(shards):
        flat_mask = mask[2 * g:2 * g + 2].reshape(-1)
        want = np.flatnonzero(flat_mask)
        assert want.size <= cap
        np.testing.assert_array_equal(idx[g, :want.size], want)
        np.testing.assert_array_equal(idx[g, want.size:], 12)        # 2 rows x 6 positions
        np.testing.assert_array_equal(got[g, :want.size], x[2 * g:2 * g + 2].reshape(12, 3)[want])
    np.testing.assert_array_equal(back, np.where(mask, x[..., 0], 0.0))
    assert loss_positions.capacity_for(4, 6, 2, 100) == 12
    assert loss_positions.capacity_for(4, 6, 2, 5) == 5
    loss_positions.check_capacity(mask, 1, shards, int(mask[:2].sum()))
    with pytest.raises(ValueError, match=r"micro-batch 0, row group 0: \d+ loss positions, "
                                         r"more than the 1 logit slots"):
        loss_positions.check_capacity(mask, 1, shards, 1)


def test_loss_slot_step_equals_full_logits_step(tiny_model):
    """Projecting only the loss positions (the learner's default) gives the loss, KL,
    entropy, IS statistics and gradients of projecting every position (packed batch, 2
    micro-batches, KL reference)."""
    graphdef, params, ref = tiny_model
    batch, _ = build_batch(records(7), SPEC, 0)
    packed, _ = pack_batch(batch, pack_spec(split=2))
    jb = TrainBatch(*packed)
    out = []
    for bound in (0, SPEC.num_rows * T):
        s = StepSettings(loss_agg="seq-mean-token-mean", norm_len=T, micro_batches=2,
                         kl_coef=0.3, correction=RolloutCorrectionConfig(weight_cap=1.5),
                         max_loss_tokens=bound)
        out.append(jax.jit(make_grad_fn(graphdef, s))(params, jb, ref))
    (l0, g0, s0), (l1, g1, s1) = out
    # the same forward up to the LM head; after it, other matmul shapes (other kernels)
    chain, n = model_chain_len(MODEL, packed.tokens.shape[1]), int(packed.loss_mask.sum())
    rtol = reorder_rtol(chain, n)
    np.testing.assert_allclose(float(l1), float(l0), rtol=rtol * MIXED_SIGN_CANCEL)
    for key in ("kl", "entropy", "is_weight", "is_kept", "mismatch/truncated_tokens",
                "is_lr_max"):
        np.testing.assert_allclose(np.asarray(s1[key]), np.asarray(s0[key]), rtol=rtol,
                                   atol=2 * F32_EPS * n if key == "kl" else 0.0, err_msg=key)
    assert float(s0["kl"]) > 0 and float(np.sum(s0["mismatch/truncated_tokens"])) > 0
    f0, f1 = flat(g0), flat(g1)
    for key in f0:
        err = np.linalg.norm(f1[key] - f0[key]) / np.linalg.norm(f0[key])
        assert err <= (2 * rtol + sum_tol(n)) * MIXED_SIGN_CANCEL, (key, err)


# -------------------------------------------------------- the learner: mesh, LoRA, default on

LEARNER_CASES = {
    "mesh": dict(num_devices=4, mesh=MeshConfig(data=2, fsdp=2), micro_batches=2, kl_coef=0.5,
                 loss_agg="seq-mean-token-mean"),
    "lora": dict(kl_coef=0.5, lora=LoraConfig(rank=4, alpha=8.0),
                 loss_agg="seq-mean-token-sum-norm"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LEARNER_CASES))
def test_packed_learner_equals_unpacked_single_device(name):
    """The default (packed) learner on data=2 x fsdp=2 fake devices with 2 micro-batches, and
    a packed LoRA learner, each equal to the unpacked single-device learner after one step."""
    kw = LEARNER_CASES[name]
    recs = records(11)
    packed = Learner(tiny_experiment(MODEL, G, T, **kw),
                     mesh=None if kw.get("num_devices", 1) > 1 else one_device_mesh())
    unpacked = Learner(tiny_experiment(MODEL, G, T, packing=False,
                                       **{**kw, "num_devices": 1, "mesh": MeshConfig()}),
                       mesh=one_device_mesh())
    assert packed.pack_spec is not None and unpacked.pack_spec is None
    mp, mu = packed.train_on(recs), unpacked.train_on(recs)
    # each group's prompt packed once: fewer real (attended) positions than the padded batch
    real_packed = mp["batch/packed_rows"] * packed.pack_spec.pack_length * (
        1 - mp["learner/packed_padding_fraction"])
    real_padded = mu["batch/samples"] * mu["batch/seq_len"] * (1 - mu["learner/padding_fraction"])
    assert real_packed < real_padded - 1
    assert_same_train_step(mp, mu, packed.params, unpacked.params, MODEL,
                           rows=8, seq=16)


@pytest.mark.background_compile
def test_worst_case_shape_compiles_in_the_background_and_takes_bigger_steps():
    """After the first packed step the learner compiles the worst-case row count on a
    background thread; a later step needing more rows than the first runs at that count,
    and the counts used are checkpointed and restored (a resumed run packs the same way)."""
    import concurrent.futures

    learner = Learner(tiny_experiment(MODEL, G, T), mesh=one_device_mesh())
    spec = learner.pack_spec
    worst, length = spec.row_counts[-1], spec.pack_length
    short = make_group_records(11, 2, vocab=VOCAB, group_size=G, max_tokens=1, noise=1.0)
    learner.train_on(short)                                 # one-token completions: few rows
    assert learner.last_compile_s > 0                       # learner/compile_s: it compiled
    (first,) = learner.packed_row_counts
    pending = learner._compiled[(worst, length)]
    assert isinstance(pending, concurrent.futures.Future)   # not compiled on the step's thread
    learner.train_on(short)
    assert learner.last_compile_s == 0.0                    # same shape: nothing to wait for
    full = records(12)
    natural, _ = pack_batch(build_batch(full, learner.batch_spec, 0)[0], spec)
    assert first < natural.tokens.shape[0] < worst          # the case under test exists
    m = learner.train_on(full)                              # more rows than the first step
    assert m["batch/packed_rows"] == worst
    assert learner.packed_row_counts == {first, worst}
    assert not isinstance(learner._compiled[(worst, length)], concurrent.futures.Future)
    assert learner.checkpoint().extra["packed_row_counts"] == [first, worst]


@pytest.mark.parametrize("shared", [False, True])
def test_segment_ids_stay_within_the_packed_positions(shared):
    """A batch whose only kept sample sits in row 40 of 40, packed into 2 x 16 positions: the
    ids are renumbered from 1 (row + 1 = 40 would pass the 32 slots loss_weights sums over),
    so the per-sequence weights of that one sample still sum to 1."""
    batch, _ = build_batch(records(3), SPEC, 0)
    tiled = TrainBatch(*(None if x is None else np.concatenate([x] * 5) for x in batch))
    loss = tiled.loss_mask.copy()
    loss[:-1] = False
    packed, _ = pack_batch(tiled._replace(loss_mask=loss), pack_spec(length=16, shared=shared))
    assert packed.tokens.size < 40
    assert packed.segment_ids.max() == 1
    w = losses.loss_weights(jnp.asarray(packed.loss_mask), "seq-mean-token-mean",
                            segment_ids=jnp.asarray(packed.segment_ids))
    np.testing.assert_allclose(float(jnp.sum(w)), 1.0, rtol=sum_tol(int(loss.sum())))
