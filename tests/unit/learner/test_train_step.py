"""The jitted train step: sharded = single device, micro-batching = one batch, it learns,
bf16 compute keeps fp32 master weights, bad batches get named errors."""

import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlflow.config import LearnerConfig, MeshConfig, ModelConfig, RolloutCorrectionConfig, replace
from rlflow.learner import losses
from rlflow.learner.batch import BatchError, BatchSpec, TrainBatch, build_batch
from rlflow.learner.step import StepSettings, make_grad_fn, policy_logprobs
from rlflow.learner.trainer import Learner
from rlflow.models.hf import build_model
from learner_fixtures import flat, make_group_records, one_device_mesh, tiny_experiment
from tolerances import (F32_EPS, MIXED_SIGN_CANCEL, chain_len, model_chain_len, reorder_rtol,
                        sum_tol)

VOCAB, G, T = 64, 4, 6
MODEL = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)


def make_records(seed, n_groups, *, noise=0.3, version=0):
    return make_group_records(seed, n_groups, vocab=VOCAB, group_size=G, max_tokens=T,
                              noise=noise, version=version)


def experiment(**learner):
    return tiny_experiment(MODEL, G, T, **learner)


@pytest.mark.slow
def test_sharded_step_equals_single_device():
    """fsdp=2 x tensor=2 on 4 fake devices vs 1 device: same loss, metrics and parameters
    after two steps (KL to the reference, IS weights, window and 2 micro-batches active)."""
    cfg = experiment(num_devices=4, mesh=MeshConfig(fsdp=2, tensor=2), micro_batches=2,
                     kl_coef=0.5, rollout_correction=RolloutCorrectionConfig(
                         reject="token", reject_low=0.5, reject_high=1.5))
    sharded, single = Learner(cfg), Learner(cfg, mesh=one_device_mesh())
    emb = sharded.params["embed"][...]
    assert len(emb.sharding.device_set) == 4 and not emb.sharding.is_fully_replicated
    init = flat(single.params)
    # sharded vs one device: other reduction orders in every matmul and token sum
    # (tests/tolerances.py): 2 chain + n positions, times eps; the loss is a mixed-sign sum,
    # the other figures sums of non-negative terms (a norm; KL k3 adds 2 eps per token).
    rows, seq = G * 2, 16
    chain, n = model_chain_len(MODEL, seq), rows * seq
    for step in range(2):
        recs = make_records(step, 2)
        m4, m1 = sharded.train_on(recs), single.train_on(recs)
        for key in ("learner/loss", "learner/grad_norm", "policy/kl", "policy/entropy",
                    "rollout_correction/masked_token_frac", "mismatch/kl_k3"):
            cancel = MIXED_SIGN_CANCEL if key == "learner/loss" else 1.0
            np.testing.assert_allclose(m4[key], m1[key], rtol=reorder_rtol(chain, n, cancel),
                                       atol=2 * F32_EPS if key == "policy/kl" else 0.0,
                                       err_msg=key)
    assert m1["policy/kl"] > 0 and 0 < m1["rollout_correction/masked_token_frac"] < 1
    got, want = flat(sharded.params), flat(single.params)
    # parameters after 2 Adam steps at lr 1e-4: each update is lr * m / sqrt(v), ~lr * sign(g)
    # early on, so rounding moves it by lr * reorder_rtol (~1e-7 here), except for an element
    # whose gradient is within rounding of 0, where m / sqrt(v) can take any value in
    # [-1, 1]: atol = lr / 10 per run admits those without admitting a wrong update (lr).
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=0.1 * 1e-4, err_msg=str(k))
        assert not np.array_equal(want[k], init[k]), k        # every parameter moved
    assert sharded.version == single.version == 2


def test_kept_params_step_equals_the_donating_step():
    """``Learner(keep_params=True)`` (what weight transfer uses): the step writes new params
    and leaves the old arrays alive and unchanged, where the donating step deletes them; the
    results are the same bits (the same computation, only the output buffers differ)."""
    cfg = tiny_experiment(replace(MODEL, num_layers=1), G, T, kl_coef=0.1)
    kept = Learner(cfg, mesh=one_device_mesh(), keep_params=True)
    donating = Learner(cfg, mesh=one_device_mesh())
    assert kept.keeps_params and not donating.keeps_params
    for step in range(2):
        recs = make_records(10 + step, 2)
        old_kept, old_donated = jax.tree.leaves(kept.params), jax.tree.leaves(donating.params)
        before = [np.asarray(x) for x in old_kept]
        m_kept, m_donated = kept.train_on(recs), donating.train_on(recs)
        assert m_kept["learner/loss"] == m_donated["learner/loss"]
        assert all(x.is_deleted() for x in old_donated)
        assert not any(x.is_deleted() for x in old_kept)
        for x, b in zip(old_kept, before):
            np.testing.assert_array_equal(np.asarray(x), b)      # never written
    got, want = flat(kept.params), flat(donating.params)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))
    new = [np.asarray(x) for x in jax.tree.leaves(kept.params)]
    assert len(new) == len(before)
    assert not any(np.array_equal(x, b) for x, b in zip(new, before))   # every param moved


@pytest.fixture(scope="module")
def tiny_model():
    model, _ = build_model(replace(MODEL, num_layers=1))
    graphdef, params = nnx.split(model, nnx.Param)
    ref = jax.tree.map(lambda p: p + 0.01 * jnp.sin(jnp.arange(p.size).reshape(p.shape)), params)
    return graphdef, params, ref


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_accumulation_equals_one_batch(tiny_model, mode):
    graphdef, params, ref = tiny_model
    batch, _ = build_batch(make_records(7, 2, noise=1.0),
                           BatchSpec(group_size=G, num_rows=8, seq_buckets=(16,), max_tokens=T), 0)
    out = {}
    for k in (1, 4):
        s = StepSettings(loss_agg=mode, norm_len=T, micro_batches=k, kl_coef=0.3,
                         correction=RolloutCorrectionConfig(
                             weight_cap=1.5, reject="token", reject_low=0.4, reject_high=2.5))
        out[k] = jax.jit(make_grad_fn(graphdef, s))(params, TrainBatch(*batch), ref)
    (l1, g1, s1), (l4, g4, s4) = out[1], out[4]
    # Tolerances from the arithmetic (tests/tolerances.py). 4 micro-batches of 2 rows vs one
    # of 8: the per-token forward may run other kernels (another reduction order), and the
    # token sums are split in 4 and added. A per-token logprob carries a relative error of
    # at most rho = chain_len * eps (forward reductions, once per pass: x2 for the two
    # passes compared); a sum over the batch's n positions adds n * eps relative to the sum
    # of its absolute terms.
    rows, seq = batch.tokens.shape
    rho = 2 * chain_len(hidden=MODEL.hidden_size, heads=MODEL.num_heads,
                        head_dim=MODEL.head_dim, intermediate=MODEL.intermediate_size,
                        layers=1, vocab=VOCAB, seq=seq) * F32_EPS
    n = rows * seq
    mask = batch.loss_mask
    w = np.asarray(losses.loss_weights(mask, mode, norm_len=T))
    # |policy-loss term| <= w * |A| * ratio * is_weight <= w * |A| * window_high * is_cap
    # (tokens outside the IS window are masked); the KL term is bounded by its sum below.
    pg_abs = float(np.sum(w * np.abs(batch.advantages))) * 2.5 * 1.5
    kl_sum = float(s1["kl"])
    # k3 = exp(r) - r - 1 cancels for small r: each token's value carries an absolute error
    # of ~(|exp(r)| + |r| + 1) u <= 2 eps (|r| << 1 here), beside rho relative to r.
    kl_atol = 2 * F32_EPS * float(mask.sum())
    loss_scale = pg_abs + 0.3 * float(np.sum(w * mask)) * (kl_sum / max(mask.sum(), 1) + 1.0)
    loss_tol = (rho + sum_tol(n)) * loss_scale
    assert abs(float(l4) - float(l1)) <= loss_tol and float(l1) != 0
    assert abs(float(s4["pg_loss"]) - float(s1["pg_loss"])) <= (rho + sum_tol(n)) * pg_abs
    # gradients: the backward pass runs the same chain again, and each weight's gradient is
    # a sum over the n positions (relative to the norm of the per-position terms; the norm
    # of the sum is a lower bound on it only without cancellation, so give it the loss's
    # ratio of absolute scale to value)
    cancel = loss_scale / abs(float(l1))
    g1, g4 = flat(g1), flat(g4)
    for key in g1:
        err = np.linalg.norm(g4[key] - g1[key]) / np.linalg.norm(g1[key])
        assert err <= (2 * rho + sum_tol(n)) * cancel, (key, err)
    # the other statistics are sums of non-negative per-token values (counts are exact
    # integers below 2**24; entropy, IS weights: rho relative per token)
    for key in s1:
        if key in ("pg_loss",):
            continue
        atol = kl_atol if key == "kl" else 0.0
        np.testing.assert_allclose(s4[key], s1[key], rtol=rho + sum_tol(n), atol=atol,
                                   err_msg=key)
    assert float(s1["kl"]) > 0 and float(s1["is_kept"]) < float(batch.loss_mask.sum())


@pytest.fixture(scope="module")
def learner():
    """One single-device learner shared by the tests below (4 rows, 2 micro-batches)."""
    return Learner(experiment(groups_per_step=1, lr=3e-3, micro_batches=2),
                   mesh=one_device_mesh())


def test_learning_smoke_positive_advantage_raises_logprobs(learner):
    """Sample 0 of the group has reward 1, the rest 0: after a few steps on the same batch the
    logprob of sample 0's completion rises and the others' fall."""
    rec = make_records(3, 1, version=learner.version)[0]
    rec["rewards"] = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    batch, _ = learner.build_batch([rec])                # packed: sample s is segment s + 1
    jbatch = TrainBatch(*batch)
    samples = [(batch.segment_ids == s + 1) & batch.loss_mask for s in range(4)]

    def seq_logprobs(params):
        logp = np.asarray(policy_logprobs(learner.graphdef, params, jbatch)[0])
        return np.array([logp[m].sum() for m in samples])

    before = seq_logprobs(learner.params)
    # on-policy behaviour logprobs so the IS weights are 1
    batch = batch._replace(behaviour_logprobs=np.asarray(
        jnp.where(batch.loss_mask, policy_logprobs(learner.graphdef, learner.params, jbatch)[0],
                  0.0)))
    for _ in range(5):
        metrics = learner.step(batch)
    after = seq_logprobs(learner.params)
    adv = [batch.advantages[m] for m in samples]
    assert all(m.any() for m in samples) and adv[0].max() > 0
    assert all((a <= 0).all() for a in adv[1:])
    assert after[0] > before[0] + 0.1, (before, after)
    assert np.all(after[1:] < before[1:]), (before, after)
    assert metrics["learner/tokens"] == batch.loss_mask.sum()
    assert metrics["policy/is_weight_max"] >= 1.0 >= metrics["policy/is_weight_min"]


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_master_params(learner, caplog):
    """bf16 activations, fp32 master parameters: the step's loss and gradient norm are close
    to the fp32 computation on the same parameters, and the parameters stay fp32."""
    with caplog.at_level(logging.INFO, logger="rlflow.learner"):
        bf16 = Learner(replace(learner.cfg, learner=replace(learner.cfg.learner,
                                                            compute_dtype="bfloat16")),
                       mesh=one_device_mesh())
        batch, info = bf16.build_batch(make_records(5, 1))
        assert info["batch/loss_tokens"] > 0
        s = bf16.settings
        loss32, g32, _ = jax.jit(make_grad_fn(learner.graphdef, s))(bf16.params, TrainBatch(*batch),
                                                                    None)
        m16 = bf16.step(batch)
        bf16.step(batch._replace(advantages=-batch.advantages))   # same bucket: no recompile
    assert len(bf16._compiled) == 1
    # one compile of this learner's step (on this thread: another learner of the module may
    # compile a packed shape in its background thread meanwhile)
    compiles = [r.getMessage() for r in caplog.records
                if "temporaries" in r.getMessage() and r.thread == threading.get_ident()]
    assert len(compiles) == 1, compiles
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(bf16.params))
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(bf16.state.opt_state)
               if hasattr(v, "dtype") and v.ndim)
    np.testing.assert_allclose(m16["learner/loss"], float(loss32), rtol=5e-2, atol=1e-3)
    np.testing.assert_allclose(m16["learner/grad_norm"], float(optax.global_norm(g32)), rtol=5e-2)
    assert m16["learner/loss"] != float(loss32)               # really computed in bf16


def test_bad_batches_get_named_errors_and_empty_mask_is_a_no_op(learner):
    batch, info = learner.build_batch(make_records(1, 1, version=learner.version))
    assert info["batch/loss_tokens"] > 0
    rows, seq = batch.tokens.shape                 # packed (the default) or padded rows
    with pytest.raises(BatchError, match=rf"advantages has shape \({rows}, {seq - 1}\), "
                                         rf"expected \({rows}, {seq}\)"):
        learner.step(batch._replace(advantages=batch.advantages[:, :-1]))
    with pytest.raises(BatchError, match="loss_mask has dtype float32"):
        learner.step(batch._replace(loss_mask=batch.loss_mask.astype(np.float32)))
    with pytest.raises(ValueError, match=f"token id {VOCAB} at index \\(1, 2\\)"):
        tokens = batch.tokens.copy()
        tokens[1, 2] = VOCAB
        learner.step(batch._replace(tokens=tokens))
    with pytest.raises(BatchError, match=f"{rows + 1} rows does not divide into"):
        learner.step(TrainBatch(*(None if x is None else np.concatenate([x, x[:1]])
                                  for x in batch)))
    learner.step(batch)                          # Adam moments are non-zero from here on
    before, version = flat(learner.params), learner.version
    empty = batch._replace(loss_mask=np.zeros_like(batch.loss_mask))
    metrics = learner.step(empty)
    assert metrics["learner/loss"] == 0.0 and metrics["learner/grad_norm"] == 0.0
    assert metrics["learner/skipped"] == 1.0 and learner.version == version
    after = flat(learner.params)
    assert all(np.array_equal(after[k], before[k]) for k in before)
    assert learner.step(batch)["learner/skipped"] == 0.0 and learner.version == version + 1
    assert all(np.isfinite(v) for v in metrics.values())


def test_adamw_clips_and_decays_matrices_only():
    from rlflow.learner.optimizer import make_optimizer

    tx, _ = make_optimizer(LearnerConfig(lr=0.1, max_grad_norm=1.0, weight_decay=0.5))
    params = {"w": jnp.ones((2, 2)), "scale": jnp.ones(2)}
    grads = {"w": jnp.full((2, 2), 3.0), "scale": jnp.full(2, 4.0)}   # norm sqrt(68)
    updates, _ = tx.update(grads, tx.init(params), params)
    # first Adam step: m/sqrt(v) = sign(g) = 1 (clipping rescales g, not the sign), so
    # update = -lr * (1 + wd * p) on matrices and -lr on vectors
    np.testing.assert_allclose(updates["w"], -0.1 * (1 + 0.5), rtol=1e-5)
    np.testing.assert_allclose(updates["scale"], -0.1, rtol=1e-5)
    # clipping really precedes Adam: clipped to norm 1e-8, the gradients are comparable to
    # Adam's eps = 1e-8, so the first update is lr * g_c / (|g_c| + eps), no longer lr * sign(g)
    tx, _ = make_optimizer(LearnerConfig(lr=0.1, max_grad_norm=1e-8))
    updates, _ = tx.update(grads, tx.init(params), params)
    g_c = 3.0 * 1e-8 / np.sqrt(68.0)
    np.testing.assert_allclose(updates["w"], -0.1 * g_c / (g_c + 1e-8), rtol=1e-4)


@pytest.mark.parametrize("unit", ["token", "sequence"])
def test_a_step_whose_every_token_the_correction_rejects_is_skipped(unit):
    """Every loss token rejected by ``learner.rollout_correction`` (behaviour logprobs 10 nats
    below the learner's: weight e^10, above ``reject_high``): no optimiser update (parameters
    and Adam moments bit-identical), no new version, ``learner/skipped`` 1; the same batch with
    one sample in band still trains."""
    corr = RolloutCorrectionConfig(reject="token", reject_low=0.5, reject_high=2.0,
                                   reject_unit=unit)
    lrn = Learner(experiment(groups_per_step=1, lr=3e-3, micro_batches=2,
                             rollout_correction=corr), mesh=one_device_mesh())
    batch, info = lrn.build_batch(make_records(3, 1, noise=0.0, version=lrn.version))
    lrn.step(batch)                                # Adam moments are non-zero from here on
    assert lrn.version == 1                        # near-uniform policy: every token in band
    mask = batch.loss_mask.astype(bool)
    far = batch.behaviour_logprobs - np.where(mask, 10.0, 0.0).astype(np.float32)
    before, opt_before = flat(lrn.params), jax.tree.map(np.asarray, lrn.state.opt_state)
    version = lrn.version
    metrics = lrn.step(batch._replace(behaviour_logprobs=far))
    assert metrics["learner/tokens"] > 0                 # the loss mask alone keeps tokens
    assert metrics["rollout_correction/masked_token_frac"] == 1.0
    assert metrics["learner/skipped"] == 1.0 and lrn.version == version
    assert metrics["learner/kept_tokens"] == 0.0
    after = flat(lrn.params)
    assert all(np.array_equal(after[k], before[k]) for k in before)
    opt_after = jax.tree.map(np.asarray, lrn.state.opt_state)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(opt_after),
                                                    jax.tree.leaves(opt_before)))
    # one sample (the first row's first segment) in band: it trains
    rows = np.nonzero(mask.any(axis=1))[0]
    seg = (batch.segment_ids == batch.segment_ids[rows[0]][mask[rows[0]]][0]
           if batch.segment_ids is not None else np.arange(mask.shape[0])[:, None] == rows[0])
    part = np.where(seg & mask, batch.behaviour_logprobs, far)
    metrics = lrn.step(batch._replace(behaviour_logprobs=part))
    assert metrics["learner/skipped"] == 0.0 and lrn.version == version + 1
    assert 0 < metrics["learner/kept_tokens"] < metrics["learner/tokens"]
    assert any(not np.array_equal(v, before[k]) for k, v in flat(lrn.params).items())
