"""PPO with a value head and GAE: decoder hidden states, value head layout, GAE targets and the
train step against numpy, sharded = single device, micro-batches = one batch, the value loss
falls, the sampler only ever sees the policy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlflow.config import (ConfigError, LearnerConfig, MeshConfig, ModelConfig,
                           RolloutCorrectionConfig, replace)
from rlflow.learner import advantages as adv_lib
from rlflow.learner.batch import BatchError, BatchSpec, TrainBatch, build_batch
from rlflow.learner.step import (StepSettings, init_state, make_grad_fn, make_train_step,
                                 policy_logprobs)
from rlflow.learner.trainer import Learner
from rlflow.learner.value import ValueHead, init_value_head
from rlflow.mesh import make_mesh, param_shardings
from rlflow.models.hf import build_model
from learner_fixtures import flat, make_group_records, one_device_mesh, tiny_experiment
from tolerances import F32_EPS, MIXED_SIGN_CANCEL, model_chain_len, reorder_rtol

VOCAB, G, T = 64, 4, 6
MODEL = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8)
SPEC = BatchSpec(group_size=G, num_rows=8, seq_buckets=(16,), max_tokens=T, estimator="gae")


def make_records(seed, n_groups, *, version=0, reward_mean=0.0):
    return make_group_records(seed, n_groups, vocab=VOCAB, group_size=G, max_tokens=T,
                              min_len=2, version=version, reward_mean=reward_mean)


def experiment(**learner):
    return tiny_experiment(MODEL, G, T, **dict(dict(advantage="gae"), **learner))


# ----------------------------------------------------------------------------- numpy oracles

def np_gae(r, v, m, gamma, lam):
    """Backward recursion over each row's valid tokens, value 0 after the last one."""
    adv = np.zeros(r.shape)
    for b in range(r.shape[0]):
        idx = np.flatnonzero(m[b])
        a_next = 0.0
        for j in reversed(range(len(idx))):
            t = idx[j]
            v_next = v[b, idx[j + 1]] if j + 1 < len(idx) else 0.0
            a_next = r[b, t] + gamma * v_next - v[b, t] + gamma * lam * a_next
            adv[b, t] = a_next
    return adv, (adv + v) * m


def np_whiten(x, m):
    sel = x[m > 0]
    return np.where(m > 0, (x - sel.mean()) / np.sqrt(sel.var() + 1e-8), 0.0)


def np_weights(m, mode):
    m = m.astype(np.float64)
    n_b = m.sum(1, keepdims=True)
    if mode == "token-mean":
        return m / m.sum()
    return m / (np.maximum(n_b, 1) * (n_b > 0).sum())            # seq-mean-token-mean


# ------------------------------------------------------------------------------- pieces

def test_decoder_returns_final_normed_hidden_states_on_the_same_forward():
    model, _ = build_model(replace(MODEL, tie_word_embeddings=False))
    scale = np.random.default_rng(0).uniform(0.5, 2.0, size=32).astype(np.float32)
    model.final_norm.scale[...] = jnp.asarray(scale)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, VOCAB, size=(2, 5)), jnp.int32)
    mask = jnp.asarray([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], bool)
    pos = jnp.maximum(jnp.cumsum(mask, 1) - 1, 0).astype(jnp.int32)
    logits = np.asarray(model(tokens, pos, mask))
    both, hidden = model(tokens, pos, mask, return_hidden=True)
    hidden = np.asarray(hidden)
    np.testing.assert_array_equal(np.asarray(both), logits)           # outputs unchanged
    assert hidden.shape == (2, 5, 32) and hidden.dtype == np.float32
    # after the final RMSNorm: hidden / scale has unit RMS over the hidden axis (up to the
    # norm's eps against this random model's small residual stream, whose own RMS is ~0.02)
    rms = np.sqrt(np.mean((hidden / scale) ** 2, axis=-1))
    np.testing.assert_allclose(rms, 1.0, rtol=5e-3)
    # and it is the input of the output projection
    np.testing.assert_allclose(hidden @ np.asarray(model.lm_head[...]), logits, rtol=1e-4,
                               atol=1e-5)


def test_value_head_values_layout_and_sharding():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(2, 3, 32)).astype(np.float32)
    zero = ValueHead(32)
    v = np.asarray(zero(jnp.asarray(h, jnp.bfloat16)))
    assert v.shape == (2, 3) and v.dtype == np.float32 and not v.any()
    head = ValueHead(32, init_std=0.5, rngs=nnx.Rngs(0))
    head.bias[...] = jnp.asarray([0.25])
    np.testing.assert_allclose(np.asarray(head(jnp.asarray(h))),
                               h @ np.asarray(head.kernel[...])[:, 0] + 0.25, rtol=1e-5)
    graphdef, params = init_value_head(32)
    assert params["kernel"].get_metadata()["out_sharding"] == ("embed", None)
    assert params["kernel"][...].dtype == jnp.float32
    sh = param_shardings(params, make_mesh(MeshConfig(fsdp=2, tensor=2), jax.devices()[:4]))
    assert tuple(sh["kernel"].get_value().spec) == ("fsdp", None)
    assert sh["bias"].get_value().is_fully_replicated


def test_ppo_targets_and_whitening_match_numpy():
    rng = np.random.default_rng(3)
    m = np.zeros((3, 7), bool)
    m[0, 1:5] = m[1, 0:7] = m[2, 3:4] = True
    r = np.zeros((3, 7), np.float32)
    for b in range(3):
        r[b, np.flatnonzero(m[b])[-1]] = rng.normal()
    v = rng.normal(size=(3, 7)).astype(np.float32)
    logp, ref = (rng.normal(size=(3, 7)).astype(np.float32) for _ in range(2))
    v_nan = np.where(m, v, np.nan).astype(np.float32)             # masked values never leak
    adv, ret = adv_lib.ppo_targets(r, v_nan, m, gamma=0.9, lam=0.8, old_logprobs=logp,
                                   ref_logprobs=ref, kl_coef=0.3)
    want_adv, want_ret = np_gae(r - 0.3 * (logp - ref) * m, np.where(m, v, 0.0), m, 0.9, 0.8)
    np.testing.assert_allclose(np.asarray(adv), want_adv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), want_ret, rtol=1e-5, atol=1e-6)
    assert np.abs(want_adv[m]).min() > 0
    np.testing.assert_allclose(np.asarray(adv_lib.masked_whiten(adv, m)),
                               np_whiten(want_adv, m), rtol=1e-4, atol=1e-5)
    # all-masked: zeros, finite
    assert not np.asarray(adv_lib.masked_whiten(adv, np.zeros_like(m))).any()


def test_build_batch_puts_the_shaped_reward_on_the_last_response_token():
    recs = make_records(0, 2)
    recs[1]["truncated"] = np.array([False, True, False, False])
    batch, info = build_batch(recs, SPEC.replace(zero_truncated_rewards=True, max_staleness=0), 0)
    assert not batch.advantages.any()                          # computed in the step
    for i, rec in enumerate(recs):
        for s in range(G):
            row = batch.token_rewards[i * G + s]
            last = np.flatnonzero(batch.loss_mask[i * G + s])[-1]
            want = 0.0 if rec["truncated"][s] else rec["rewards"][s]
            assert row[last] == np.float32(want) and np.count_nonzero(np.delete(row, last)) == 0
    assert not batch.token_rewards[len(recs) * G:].any()


def with_environment_tokens(records):
    """Multi-turn episodes: completion tokens 1 and 2 of every completion of >= 4 tokens
    become environment tokens (loss_mask 0, logprob 0, version -1) between two turns."""
    for rec in records:
        n = rec["completion_lengths"]
        t = np.arange(rec["completion_tokens"].shape[1])[None, :]
        env = (n[:, None] >= 4) & ((t == 1) | (t == 2))
        rec["loss_mask"] = (t < n[:, None]) & ~env
        rec["behaviour_logprobs"] = np.where(env, 0.0, rec["behaviour_logprobs"]).astype(
            np.float32)
        rec["policy_versions"] = np.where(env, -1, rec["policy_versions"]).astype(np.int32)
    return records


@pytest.mark.parametrize("case", [
    dict(whiten=False, gamma=0.9, lam=0.8, mode="token-mean", kl=False),
    dict(whiten=True, gamma=1.0, lam=0.95, mode="seq-mean-token-mean", kl=True),
    dict(whiten=False, gamma=0.9, lam=0.8, mode="token-mean", kl=False, multi_turn=True)])
def test_ppo_step_matches_numpy_oracle(case):
    """Through the pure step with SGD: loss, value metrics, and the updated value head and
    policy against numpy GAE / whitening / value loss on the same forward's outputs. Multi-turn
    (issue 44.6): GAE runs over the sampled tokens only, across the environment's tokens."""
    model, _ = build_model(MODEL)
    graphdef, params = nnx.split(model, nnx.Param)
    vgraph, vparams = init_value_head(32, init_std=0.3, seed=1)
    vparams["bias"][...] = jnp.asarray([0.4])
    ref = jax.tree.map(lambda p: p + 0.05 * jnp.sin(jnp.arange(p.size).reshape(p.shape)), params)
    records = make_records(5, 2, reward_mean=1.0)
    if case.get("multi_turn"):
        records = with_environment_tokens(records)
    batch, _ = build_batch(records, SPEC, 0)
    if case.get("multi_turn"):         # some rows do have a gap inside their loss positions
        spans = [np.flatnonzero(row) for row in batch.loss_mask if row.any()]
        assert any(s[-1] - s[0] + 1 > len(s) for s in spans)
    jb = TrainBatch(*(None if x is None else jnp.asarray(x) for x in batch))
    kl_coef, vcoef, lr = 0.2, 0.5, 0.1
    s = StepSettings(loss_agg=case["mode"], norm_len=T,
                     correction=RolloutCorrectionConfig(weight="off"), gae=True,
                     gae_gamma=case["gamma"], gae_lambda=case["lam"], value_coef=vcoef,
                     value_clip=0.2, whiten=case["whiten"], kl_coef=kl_coef if case["kl"] else 0.0,
                     kl_in_reward=case["kl"])
    tx = optax.sgd(lr)
    step = jax.jit(make_train_step(graphdef, tx, optax.constant_schedule(lr), s,
                                   value_graphdef=vgraph))
    new, metrics = step(init_state(params, tx, value=vparams), jb, ref if case["kl"] else None)

    # oracle inputs: the decoder's hidden states and logprobs (tested on their own)
    _, hidden = nnx.merge(graphdef, params)(jb.tokens, jb.positions, jb.attention_mask,
                                            return_hidden=True)
    hidden = np.asarray(hidden, np.float64)
    k, b0 = np.asarray(vparams["kernel"][...], np.float64)[:, 0], 0.4
    m = batch.loss_mask
    v = hidden @ k + b0
    r = batch.token_rewards.astype(np.float64)
    if case["kl"]:
        logp = np.asarray(policy_logprobs(graphdef, params, jb)[0], np.float64)
        ref_logp = np.asarray(policy_logprobs(graphdef, ref, jb)[0], np.float64)
        r = r - kl_coef * (logp - ref_logp) * m
    adv, ret = np_gae(r, v * m, m, case["gamma"], case["lam"])
    if case["whiten"]:
        adv = np_whiten(adv, m)
    w = np_weights(m, case["mode"])
    pg = np.sum(w * -adv)                  # ratio 1 at the step start, no IS weight (cap 0)
    vl = np.sum(w * 0.5 * (v - ret) ** 2)  # clip inactive: V = V_old at the step start
    np.testing.assert_allclose(float(metrics["learner/pg_loss"]), pg, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(metrics["value/loss"]), vl, rtol=1e-4)
    np.testing.assert_allclose(float(metrics["learner/loss"]), pg + vcoef * vl, rtol=1e-4,
                               atol=1e-6)
    np.testing.assert_allclose(float(metrics["value/mean"]), v[m].mean(), rtol=1e-4)
    np.testing.assert_allclose(float(metrics["value/return_mean"]), ret[m].mean(), rtol=1e-4)
    ev = 1 - np.var(ret[m] - v[m]) / np.var(ret[m])
    np.testing.assert_allclose(float(metrics["value/explained_variance"]), ev, rtol=1e-3,
                               atol=1e-4)
    # value head: dL/dV_t = value_coef * w_t (V_t - R_t) (advantages and V_old are detached)
    g_v = vcoef * w * (v - ret)
    np.testing.assert_allclose(np.asarray(new.value["kernel"][...])[:, 0],
                               k - lr * np.einsum("bt,bte->e", g_v, hidden), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(new.value["bias"][...][0]), b0 - lr * g_v.sum(), rtol=1e-5)

    # policy trunk: the gradient of the oracle's loss written directly in jnp
    adv_c, ret_c, w_c = (jnp.asarray(x, jnp.float32) for x in (adv, ret, w))

    def oracle_loss(p):
        logits, h = nnx.merge(graphdef, p)(jb.tokens, jb.positions, jb.attention_mask,
                                           return_hidden=True)
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits), jb.targets[..., None], -1)[..., 0]
        val = h @ vparams["kernel"][...][:, 0] + 0.4
        ratio = jnp.exp(lp - jax.lax.stop_gradient(lp))
        return jnp.sum(w_c * (-adv_c * ratio + vcoef * 0.5 * (val - ret_c) ** 2))

    grads = jax.grad(oracle_loss)(params)
    want = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    got, want = flat(new.params), flat(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=str(key))
    assert int(new.step) == 1


@pytest.mark.parametrize("whiten,mode,kl", [(True, "token-mean", True),
                                            (False, "seq-mean-token-sum-norm", False)])
def test_ppo_micro_batches_equal_one_batch(whiten, mode, kl):
    """k = 4 micro-batches (with whitening: through the old-values pass) equal one batch."""
    model, _ = build_model(MODEL)
    graphdef, params = nnx.split(model, nnx.Param)
    vgraph, vparams = init_value_head(32, init_std=0.3, seed=2)
    ref = jax.tree.map(lambda p: p + 0.05 * jnp.cos(jnp.arange(p.size).reshape(p.shape)), params)
    batch, _ = build_batch(make_records(9, 2), SPEC, 0)
    out = {}
    for k in (1, 4):
        s = StepSettings(loss_agg=mode, norm_len=T, micro_batches=k, gae=True, whiten=whiten,
                         kl_coef=0.3, kl_in_reward=kl, value_clip=0.1)
        out[k] = jax.jit(make_grad_fn(graphdef, s, value_graphdef=vgraph))(
            (params, vparams), TrainBatch(*batch), ref)
    (l1, g1, s1), (l4, g4, s4) = out[1], out[4]
    # 4 micro-batches vs one batch (tests/tolerances.py): the forward chain twice, the
    # batch's n positions summed; GAE adds a reduction over the sequence (T) and whitening
    # one over the batch (n); mixed-sign sums (loss, gradients, advantages) get the
    # cancellation allowance, the gradients the backward chain once more.
    rows, seq = batch.tokens.shape
    chain = model_chain_len(MODEL, seq) + T
    n = 2 * rows * seq
    rtol = reorder_rtol(chain, n, MIXED_SIGN_CANCEL)
    assert abs(float(l4) - float(l1)) <= rtol * abs(float(l1)) and float(l1) != 0
    for part in (0, 1):                                  # policy, value head
        a, b = flat(g1[part]), flat(g4[part])
        for key in a:
            err = np.linalg.norm(b[key] - a[key]) / np.linalg.norm(a[key])
            assert err <= reorder_rtol(2 * chain, n, MIXED_SIGN_CANCEL), (part, key, err)
    for key in s1:
        # value/return sums have terms of both signs (returns, residuals); KL k3 cancels
        # (2 eps absolute per token)
        np.testing.assert_allclose(s4[key], s1[key], rtol=rtol,
                                   atol=2 * F32_EPS * float(batch.loss_mask.sum()), err_msg=key)
    assert float(s1["value_loss"]) > 0 and float(s1["kl"]) > 0


@pytest.mark.slow
def test_ppo_sharded_step_equals_single_device():
    """fsdp=2 x tensor=2 on 4 fake devices vs 1 device: same loss, value metrics, policy and
    value-head parameters after two steps (whitening over 2 micro-batches, KL in reward)."""
    cfg = experiment(num_devices=4, mesh=MeshConfig(fsdp=2, tensor=2), micro_batches=2,
                     kl_coef=0.2, gae_kl_in_reward=True)
    sharded, single = Learner(cfg), Learner(cfg, mesh=one_device_mesh())
    kernel = sharded.value_params["kernel"][...]
    assert len(kernel.sharding.device_set) == 4 and not kernel.sharding.is_fully_replicated
    init, vinit = flat(single.params), flat(single.value_params)
    rows, seq = G * 2, 16
    rtol = reorder_rtol(model_chain_len(MODEL, seq) + T, 2 * rows * seq, MIXED_SIGN_CANCEL)
    for step in range(2):
        recs = make_records(step, 2, reward_mean=0.5)
        m4, m1 = sharded.train_on(recs), single.train_on(recs)
        for key in ("learner/loss", "learner/grad_norm", "value/loss", "value/mean",
                    "value/explained_variance", "policy/kl"):
            # sharded vs one device: as in test_ppo_micro_batches_equal_one_batch
            np.testing.assert_allclose(m4[key], m1[key], rtol=rtol, atol=2 * F32_EPS,
                                       err_msg=key)
    assert m1["value/loss"] > 0 and m1["value/mean"] != 0 and m1["policy/kl"] > 0
    for got, want, before in ((flat(sharded.params), flat(single.params), init),
                              (flat(sharded.value_params), flat(single.value_params), vinit)):
        for k in want:
            # Adam at lr 1e-4: atol = lr / 10 (see test_sharded_step_equals_single_device)
            np.testing.assert_allclose(got[k], want[k], atol=0.1 * 1e-4, err_msg=str(k))
            assert not np.array_equal(want[k], before[k]), k      # every parameter moved
    assert sharded.version == single.version == 2


def test_value_loss_falls_and_only_the_policy_is_published():
    """Six steps on one fixed batch (Adam, lr 3e-3): the value loss falls every step and by
    more than 15 %, and the explained variance rises from 0 (zero-initialised head)."""
    learner = Learner(experiment(groups_per_step=1, lr=3e-3, micro_batches=2),
                      mesh=one_device_mesh())
    decoder_keys = set(flat(nnx.state(build_model(MODEL)[0], nnx.Param)))
    assert set(flat(learner.params)) == decoder_keys               # what publish/export see
    assert set(flat(learner.value_params)) == {("kernel",), ("bias",)}
    batch, _ = learner.build_batch(make_records(4, 1, version=0, reward_mean=1.0))
    with pytest.raises(BatchError, match="token_rewards is None"):
        learner.step(batch._replace(token_rewards=None))
    losses, evs = [], []
    for _ in range(6):
        metrics = learner.step(batch)
        losses.append(metrics["value/loss"])
        evs.append(metrics["value/explained_variance"])
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.85 * losses[0], losses
    assert evs[0] == 0.0 and evs[-1] > 0.05, evs
    assert all(np.isfinite(v) for v in metrics.values())


def test_ppo_config_is_validated():
    LearnerConfig(advantage="gae", gae_lambda=0.0, gae_gamma=1.0, value_clip=0.0)
    for kw, field in ((dict(gae_lambda=1.5), "learner.gae_lambda"),
                      (dict(gae_gamma=-0.1), "learner.gae_gamma"),
                      (dict(value_coef=0.0), "learner.value_coef"),
                      (dict(value_clip=-1.0), "learner.value_clip"),
                      (dict(scale_by_std=True), "learner.scale_by_std"),
                      (dict(gae_kl_in_reward=True), "learner.gae_kl_in_reward")):
        with pytest.raises(ConfigError, match=field):
            LearnerConfig(advantage="gae", **kw)
    with pytest.raises(ConfigError, match="learner.gae_kl_in_reward"):
        LearnerConfig(advantage="grpo", kl_coef=0.1, gae_kl_in_reward=True)


def test_ppo_state_round_trips_through_checkpointer_and_resumes(tmp_path):
    """A PPO learner saves policy, optimiser state and value head (its own ``value`` item,
    not inside ``params``); a fresh learner resumes it with the value head equal and takes
    the same next step as the original; export reads the policy alone; a PPO learner
    resuming a checkpoint without value head gets a named error."""
    from rlflow.checkpoint import CheckpointError, Checkpointer, restore_params
    from rlflow.config import CheckpointConfig

    cfg = experiment(groups_per_step=1, lr=3e-3)
    first = Learner(cfg, mesh=one_device_mesh())
    first.train_on(make_records(0, 1, version=0, reward_mean=1.0))
    value_saved = flat(first.value_params)
    assert any(np.any(v != 0) for v in value_saved.values())        # the head has moved
    with Checkpointer(str(tmp_path / "ck"), CheckpointConfig(), async_save=False) as ck:
        ck.save(first.checkpoint(extra={"n": 1}), force=True)
    resumed = Learner(cfg, mesh=one_device_mesh())
    assert all(np.all(v == 0) for v in flat(resumed.value_params).values())
    with Checkpointer(str(tmp_path / "ck"), CheckpointConfig()) as ck:
        got = resumed.resume(ck)
    assert got.step == 1 and resumed.version == 1 and got.extra == {"n": 1}
    for k, v in flat(resumed.value_params).items():
        np.testing.assert_array_equal(v, value_saved[k], err_msg=str(k))
    for k, v in flat(resumed.params).items():
        np.testing.assert_array_equal(v, flat(first.params)[k], err_msg=str(k))
    # same next step (the Adam moments of policy and value head came back too)
    recs = make_records(1, 1, version=1, reward_mean=1.0)
    m_first, m_resumed = first.train_on(recs), resumed.train_on(recs)
    # the same compiled program on bit-identical state and batch: bit-identical on CPU
    # (XLA:CPU sums in a fixed order for a fixed program and shape)
    for key in ("learner/loss", "value/loss", "value/mean", "learner/grad_norm"):
        assert m_resumed[key] == m_first[key], key
    for k, v in flat(resumed.value_params).items():
        np.testing.assert_array_equal(v, flat(first.value_params)[k], err_msg=str(k))
    # export: params item is the policy alone
    _, host_params, _ = restore_params(str(tmp_path / "ck"))
    assert len(jax.tree.leaves(host_params)) == len(flat(first.params))
    assert "kernel" not in host_params and "bias" not in host_params
    # a checkpoint saved without value head does not resume a PPO learner silently
    with Checkpointer(str(tmp_path / "nov"), CheckpointConfig(), async_save=False) as ck:
        ck.save(dataclasses.replace(first.checkpoint(), value=None), force=True)
    with Checkpointer(str(tmp_path / "nov"), CheckpointConfig()) as ck:
        with pytest.raises(CheckpointError, match="has no 'value' item"):
            first.resume(ck)                 # raises before touching the state
