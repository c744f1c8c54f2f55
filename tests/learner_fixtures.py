"""Shared builders for the learner tests: random group records, a tiny experiment, meshes."""

import jax
import numpy as np
from flax import nnx

from rlflow.config import ExperimentConfig, LearnerConfig, MeshConfig, SamplerConfig
from rlflow.mesh import make_mesh


def make_group_records(seed, n_groups, *, vocab, group_size, max_tokens, min_len=1,
                       noise=0.3, version=0, reward_mean=0.0):
    """``n_groups`` rollout group records (docs/interfaces.md) with random prompts, completions
    of ``min_len..max_tokens`` tokens, behaviour logprobs near uniform, one policy version."""
    rng = np.random.default_rng(seed)
    g, t = group_size, max_tokens
    out = []
    for i in range(n_groups):
        lens = rng.integers(min_len, t + 1, size=g).astype(np.int32)
        ct = np.zeros((g, t), np.int32)
        mu = np.zeros((g, t), np.float32)
        ver = np.full((g, t), -1, np.int32)
        for s in range(g):
            ct[s, :lens[s]] = rng.integers(1, vocab, size=lens[s])
            mu[s, :lens[s]] = -np.log(vocab) + rng.normal(scale=noise, size=lens[s])
            ver[s, :lens[s]] = version
        prompt = rng.integers(1, vocab, size=rng.integers(2, 6)).astype(np.int32)
        out.append(dict(prompt_id=np.int64(i), prompt_tokens=prompt,
                        completion_tokens=ct, completion_lengths=lens, behaviour_logprobs=mu,
                        policy_versions=ver,
                        rewards=(reward_mean + rng.normal(size=g)).astype(np.float32),
                        truncated=lens == t))
    return out


def tiny_experiment(model, group_size, max_tokens, **learner):
    """An ExperimentConfig around ``model`` with 2 groups per step and one 16-token bucket."""
    base = dict(groups_per_step=2, seq_buckets=(16,), lr=1e-4)
    base.update(learner)
    return ExperimentConfig(model=model,
                            sampler=SamplerConfig(group_size=group_size, max_tokens=max_tokens,
                                                  max_prefill_length=8, prefill_buckets=(8,)),
                            learner=LearnerConfig(**base))


def one_device_mesh():
    return make_mesh(MeshConfig(), jax.devices()[:1])


def flat(params):
    """``{path: numpy array}`` of an nnx.State."""
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(params)}


def assert_same_train_step(ma: dict, mb: dict, params_a, params_b, model_cfg, rows: int,
                           seq: int) -> None:
    """Two learners' step metrics and updated parameters agree: loss, grad norm, KL,
    entropy and token count within the reordering bound of ``rows x seq`` positions through
    ``model_cfg``'s reduction chain (tests/tolerances.py), and one Adam step at lr 1e-4
    (~lr * sign(g)) within lr / 10 (rounding near g = 0 can flip a sign)."""
    from tolerances import F32_EPS, MIXED_SIGN_CANCEL, model_chain_len, reorder_rtol

    chain, n = model_chain_len(model_cfg, seq), rows * seq
    for key in ("learner/loss", "learner/grad_norm", "policy/kl", "policy/entropy",
                "learner/tokens"):
        cancel = MIXED_SIGN_CANCEL if key == "learner/loss" else 1.0
        np.testing.assert_allclose(ma[key], mb[key], rtol=reorder_rtol(chain, n, cancel),
                                   atol=2 * F32_EPS * n if key == "policy/kl" else 0.0,
                                   err_msg=key)
    got, want = flat(params_a), flat(params_b)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=0.1 * 1e-4, err_msg=str(k))


def assert_same_packed_step(model_cfg, packed, today, new) -> None:
    """One grad step of a packed batch (``packed``: its :class:`TrainBatch` fields, numpy) on
    two paths agrees: ``today`` and ``new`` are each ``(loss, grads, stats, logprobs)`` of
    ``make_grad_fn`` and ``policy_logprobs``. Logprobs on the loss positions within
    ``2 x chain x eps`` of their scale, the loss and the KL / entropy / importance-weight sums
    within the reordering bound of the loss positions (tests/tolerances.py), each gradient
    leaf's relative error within twice that plus a sum's rounding."""
    from tolerances import (F32_EPS, MIXED_SIGN_CANCEL, model_chain_len, reorder_rtol,
                            sum_tol)

    (l0, g0, s0, lp0), (l1, g1, s1, lp1) = today, new
    lp0, lp1 = np.asarray(lp0), np.asarray(lp1)
    chain, n = model_chain_len(model_cfg, packed.tokens.shape[1]), int(packed.loss_mask.sum())
    rtol = reorder_rtol(chain, n)
    m = packed.loss_mask
    np.testing.assert_allclose(lp1[m], lp0[m], rtol=0,
                               atol=2 * chain * F32_EPS * (np.abs(lp0[m]).max() + 1))
    np.testing.assert_allclose(float(l1), float(l0), rtol=rtol * MIXED_SIGN_CANCEL)
    for key in ("kl", "entropy", "is_weight", "is_kept", "mismatch/truncated_tokens"):
        np.testing.assert_allclose(np.asarray(s1[key]), np.asarray(s0[key]), rtol=rtol,
                                   atol=2 * F32_EPS * n if key == "kl" else 0.0, err_msg=key)
    assert float(s0["kl"]) > 0
    f0, f1 = flat(g0), flat(g1)
    for key in f0:
        err = np.linalg.norm(f1[key] - f0[key]) / np.linalg.norm(f0[key])
        assert err <= (2 * rtol + sum_tol(n)) * MIXED_SIGN_CANCEL, (key, err)


def model_and_reference(model_cfg):
    """A random model of ``model_cfg`` split for the train step: ``(graphdef, params, ref)``,
    ``ref`` the params moved by ``0.01 sin(i)`` (element ``i`` of each leaf): a KL reference
    policy close to, not equal to, the policy."""
    import jax.numpy as jnp

    from rlflow.models.hf import build_model

    model, _ = build_model(model_cfg)
    graphdef, params = nnx.split(model, nnx.Param)
    ref = jax.tree.map(lambda p: p + 0.01 * jnp.sin(jnp.arange(p.size).reshape(p.shape)), params)
    return graphdef, params, ref
