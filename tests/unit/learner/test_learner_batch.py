"""Group records -> training batch: layout, masks, staleness, shaping and bad input."""

import numpy as np
import pytest

from rlflow.config import ExperimentConfig, LearnerConfig, RuntimeConfig, SamplerConfig
from rlflow.learner import losses
from rlflow.learner.batch import (BatchError, BatchSpec, build_batch, sample_staleness,
                                  stale_keep)
from tolerances import F32_EPS, sum_tol


def record(prompt, completions, rewards, *, truncated=None, versions=None, pid=0, width=None):
    g = len(completions)
    width = width or max(len(c) for c in completions)
    toks = np.zeros((g, width), np.int32)
    mu = np.zeros((g, width), np.float32)
    ver = np.full((g, width), -1, np.int32)
    for i, c in enumerate(completions):
        toks[i, :len(c)] = c
        mu[i, :len(c)] = -0.1 * (np.arange(len(c)) + 1) - i
        ver[i, :len(c)] = 5 if versions is None else versions[i]
    return dict(prompt_id=np.int64(pid), prompt_tokens=np.asarray(prompt, np.int32),
                completion_tokens=toks, completion_lengths=np.array([len(c) for c in completions],
                                                                    np.int32),
                behaviour_logprobs=mu, policy_versions=ver,
                rewards=np.asarray(rewards, np.float32),
                truncated=np.asarray(truncated if truncated is not None else [False] * g))


def spec(**kw):
    base = dict(group_size=2, num_rows=4, seq_buckets=(8, 16), max_tokens=6,
                estimator="drgrpo", max_staleness=1)
    base.update(kw)
    return BatchSpec(**base)


def test_prompt_response_boundary_hello_world():
    """[Hello | , World ! <eot>] with prompt length 1: 4 targets, EOS included, denominator 4."""
    hello, comma, world, bang, eot = 11, 12, 13, 14, 2
    rec = record([hello], [[comma, world, bang, eot]], [1.0])
    b, info = build_batch([rec], spec(group_size=1, num_rows=1, seq_buckets=(5,)), 5)
    np.testing.assert_array_equal(b.tokens[0], [hello, comma, world, bang, eot])
    np.testing.assert_array_equal(b.targets[0, :4], [comma, world, bang, eot])
    np.testing.assert_array_equal(b.loss_mask[0], [1, 1, 1, 1, 0])
    np.testing.assert_allclose(b.behaviour_logprobs[0, :4], rec["behaviour_logprobs"][0])
    assert info["batch/loss_tokens"] == 4
    w = losses.loss_weights(b.loss_mask, "token-mean")
    np.testing.assert_allclose(np.asarray(w)[0], [0.25] * 4 + [0])


def test_left_padded_prompts_right_padded_completions():
    recs = [record([7, 8, 9], [[1, 2], [3]], [1.0, 0.0], pid=3),
            record([5], [[4, 4, 4], [6]], [0.0, 0.0], pid=4)]
    b, info = build_batch(recs, spec(), 5)
    assert b.tokens.shape == (4, 8) and info["batch/seq_len"] == 8   # need 3 + 3 -> bucket 8
    np.testing.assert_array_equal(b.tokens[0], [7, 8, 9, 1, 2, 0, 0, 0])
    np.testing.assert_array_equal(b.tokens[2], [0, 0, 5, 4, 4, 4, 0, 0])
    np.testing.assert_array_equal(b.attention_mask[2], [0, 0, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(b.positions[2, 2:6], [0, 1, 2, 3])
    np.testing.assert_array_equal(b.loss_mask[2], [0, 0, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(b.targets[2, 2:5], [4, 4, 4])
    # advantages (Dr. GRPO: r - mean) broadcast over exactly the loss positions
    np.testing.assert_allclose(b.advantages[0], [0, 0, 0.5, 0.5, 0, 0, 0, 0])
    np.testing.assert_allclose(b.advantages[1], [0, 0, -0.5, 0, 0, 0, 0, 0])
    assert not b.advantages[2:].any()                                 # equal rewards -> 0


def test_padding_rows_are_inert():
    b, info = build_batch([record([5], [[1, 2], [3]], [1.0, 0.0])], spec(num_rows=4), 5)
    assert not b.loss_mask[2:].any() and b.attention_mask[2:, 0].all()
    assert info["batch/samples"] == 2 and info["batch/loss_samples"] == 2


def test_mask_truncated_case():
    """A: 3 tokens ending in EOS; B: 2 tokens cut by max_tokens; loss 1.0 per token -> 1.0."""
    rec = record([5], [[1, 2, 2], [3, 3]], [1.0, 0.0], truncated=[False, True])
    b, info = build_batch([rec], spec(num_rows=2, mask_truncated=True), 5)
    ones = np.ones(b.loss_mask.shape, np.float32)
    assert float(losses.aggregate(ones, b.loss_mask, "token-mean")) == pytest.approx(1.0)
    b2, _ = build_batch([rec], spec(num_rows=2), 5)
    assert float(losses.aggregate(ones, b2.loss_mask, "token-mean")) == pytest.approx(1.0)
    assert int(b.loss_mask.sum()) == 3 and int(b2.loss_mask.sum()) == 5
    all_trunc = record([5], [[1, 2], [3, 3]], [1.0, 0.0], truncated=[True, True])
    b3, info3 = build_batch([all_trunc], spec(num_rows=2, mask_truncated=True), 5)
    assert not b3.loss_mask.any() and info3["batch/loss_tokens"] == 0
    assert float(losses.aggregate(ones, b3.loss_mask, "token-mean")) == 0.0


def test_zero_truncated_rewards_and_overlong_shaping():
    rec = record([5], [[1], [1], [1, 1, 1, 1, 1], [1, 1, 1, 1]], [1, 0, 1, 1],
                 truncated=[False, False, True, False])
    s = spec(group_size=4, num_rows=4, zero_truncated_rewards=True)
    b, info = build_batch([rec], s, 5)
    shaped = np.array([1, 0, 0, 1.0])
    np.testing.assert_allclose(b.advantages[:, 0], shaped - shaped.mean())
    # overlong: max_tokens 6, buffer 4 -> lengths 1,1,5,4 get 0,0,-0.75,-0.5 (factor 1)
    b, _ = build_batch([rec], s.replace(zero_truncated_rewards=False, overlong_buffer=4), 5)
    shaped = np.array([1, 0, 1 - 0.75, 1 - 0.5])
    # float32 shaping and a mean over 4 rewards vs float64: 4 eps of the largest reward
    np.testing.assert_allclose(b.advantages[:, 0], shaped - shaped.mean(), rtol=0,
                               atol=sum_tol(4 + 2, np.abs(shaped).max()))


def test_dynamic_sampling_drops_zero_variance_groups():
    recs = [record([5], [[1], [2]], [1.0, 1.0]), record([5], [[1], [2]], [1.0, 0.0])]
    b, info = build_batch(recs, spec(dynamic_sampling=True), 5)
    np.testing.assert_array_equal(b.loss_mask.any(1), [False, False, True, True])
    assert info["batch/dropped_zero_variance_groups"] == 1


def test_staleness_pure_functions():
    versions = np.array([[3, 4, -1], [5, 5, 5], [2, -1, -1]])
    stale = sample_staleness(versions, [2, 3, 1], learner_version=5)
    np.testing.assert_array_equal(stale, [2, 0, 3])
    np.testing.assert_array_equal(stale_keep(stale, 2, "drop"), [True, True, False])
    np.testing.assert_array_equal(stale_keep(stale, 2, "correct"), [True, True, True])
    with pytest.raises(ValueError, match="newer than the learner"):
        sample_staleness(versions, [2, 3, 1], learner_version=3)
    with pytest.raises(ValueError, match="sample 0: policy_versions has -1"):
        sample_staleness(versions, [3, 3, 1], learner_version=5)


def test_stale_samples_dropped_or_kept_and_histogram():
    rec = record([5], [[1, 1], [2, 2]], [1.0, 0.0], versions=[[9, 9], [6, 7]])
    b, info = build_batch([rec], spec(num_rows=2, max_staleness=2), 9)   # staleness 0 and 3
    np.testing.assert_array_equal(b.loss_mask.any(1), [True, False])
    assert info["batch/dropped_stale"] == 1
    assert info["staleness/frac_0"] == 0.5 and info["staleness/frac_3plus"] == 0.5
    assert info["staleness/max"] == 3
    b, info = build_batch([rec], spec(num_rows=2, max_staleness=2, stale_policy="correct"), 9)
    np.testing.assert_array_equal(b.loss_mask.any(1), [True, True])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_reward_error_or_drop(bad):
    recs = [record([5], [[1], [2]], [1.0, 0.0], pid=10),
            record([5], [[1], [2]], [bad, 0.0], pid=11)]
    with pytest.raises(BatchError, match=r"record 1 \(prompt_id 11\), sample 0: reward is"):
        build_batch(recs, spec(), 5)
    b, info = build_batch(recs, spec(on_bad_reward="drop"), 5)
    assert info["batch/dropped_bad_reward_groups"] == 1
    np.testing.assert_array_equal(b.loss_mask.any(1), [True, True, False, False])
    assert np.isfinite(b.advantages).all()


def test_bad_records_named_errors():
    good = record([5], [[1], [2]], [1.0, 0.0], pid=7)
    with pytest.raises(BatchError, match="has 3 samples, expected group_size 2"):
        build_batch([record([5], [[1], [2], [3]], [1, 0, 0])], spec(), 5)
    bad = dict(good, rewards=np.zeros(3, np.float32))
    with pytest.raises(BatchError, match=r"record 1 \(prompt_id 7\): rewards has shape \(3,\)"):
        build_batch([good, bad], spec(), 5)
    bad = dict(good, behaviour_logprobs=np.zeros((2, 5), np.float32))
    with pytest.raises(BatchError, match="behaviour_logprobs has shape"):
        build_batch([bad], spec(), 5)
    bad = dict(good, completion_lengths=np.array([1, 0], np.int32))
    with pytest.raises(BatchError, match="sample 1: completion_lengths 0 must be in"):
        build_batch([bad], spec(), 5)
    bad = dict(good, prompt_tokens=np.zeros(0, np.int32))
    with pytest.raises(BatchError, match="prompt_tokens must be"):
        build_batch([bad], spec(), 5)
    with pytest.raises(BatchError, match="exceed the batch of 4 rows"):
        build_batch([good] * 3, spec(), 5)
    with pytest.raises(BatchError, match="exceed the largest seq bucket 8"):
        build_batch([record([5] * 6, [[1, 1, 1], [2]], [1, 0])], spec(seq_buckets=(8,)), 5)
    bad = dict(good, behaviour_logprobs=np.array([[np.nan], [0.0]], np.float32))
    with pytest.raises(BatchError, match="behaviour_logprobs at completion token 0"):
        build_batch([bad], spec(), 5)


def test_spec_from_experiment_config():
    cfg = ExperimentConfig(sampler=SamplerConfig(group_size=4, max_tokens=8, max_prefill_length=16,
                                                 prefill_buckets=(16,)),
                           learner=LearnerConfig(groups_per_step=2, advantage="rloo"),
                           runtime=RuntimeConfig(max_staleness=3))
    s = BatchSpec.from_config(cfg)
    assert (s.num_rows, s.seq_buckets, s.estimator, s.max_staleness) == (8, (24,), "rloo", 3)


@pytest.mark.parametrize("bad, field", [
    (dict(advantage="drgrpo", scale_by_std=True), "learner.scale_by_std"),
    (dict(off_policy="proximal"), "learner.off_policy"),
    (dict(is_cap=2.0, is_floor=3.0), "learner.rollout_correction.weight_floor"),
    (dict(is_cap=2.0, is_floor=3.0), "learner.is_floor"),
    (dict(is_window_low=1.5), "learner.is_window_low"),
    (dict(is_window_high=0.5), "learner.rollout_correction.reject_high"),
    (dict(is_cap=-1.0), "learner.is_cap"),
    (dict(overlong_buffer=-1), "learner.overlong_buffer"),
    (dict(on_bad_reward="skip"), "learner.on_bad_reward"),
    (dict(seq_buckets=(32, 16)), "learner.seq_buckets"),
])
def test_learner_config_validation_names_the_field(bad, field):
    from rlflow.config import ConfigError
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        LearnerConfig(**bad)


def test_experiment_checks_micro_batches_and_overlong_buffer():
    from rlflow.config import ConfigError, MeshConfig
    with pytest.raises(ConfigError, match="learner.micro_batches"):
        ExperimentConfig(learner=LearnerConfig(groups_per_step=1, micro_batches=8))
    with pytest.raises(ConfigError, match="learner.micro_batches"):
        ExperimentConfig(learner=LearnerConfig(groups_per_step=1, micro_batches=2, num_devices=4,
                                               mesh=MeshConfig(fsdp=4)))
    with pytest.raises(ConfigError, match="learner.overlong_buffer"):
        ExperimentConfig(learner=LearnerConfig(overlong_buffer=100))


# ------------------------------------------------------------- host (numpy) path = jnp reference

@pytest.mark.parametrize("estimator,scale", [("grpo", None), ("grpo", False), ("drgrpo", None),
                                             ("rloo", None), ("rloo", True)])
def test_host_advantages_equal_jnp_reference(estimator, scale):
    """The xp=numpy path of every reward-level function equals the jnp default on random
    rewards (with all-equal groups), lengths and truncation flags."""
    import jax.numpy as jnp
    from rlflow.learner import advantages as adv

    rng = np.random.default_rng(3)
    for n, g in ((5, 8), (3, 2), (16, 4)):
        r = rng.normal(size=(n, g)).astype(np.float32) * rng.choice([0.01, 1.0, 30.0])
        r[0] = 0.35                                                # zero-variance group
        r[-1] = rng.integers(0, 2, size=g)                         # 0/1 rewards
        got = adv.group_advantages(r, estimator=estimator, scale_by_std=scale, xp=np)
        ref = np.asarray(adv.group_advantages(r, estimator=estimator, scale_by_std=scale))
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        # numpy vs jax, both float32: mean and std are sums over the g rewards of a group
        # (other orders), a few more ops for the division and sqrt: (2 g + 4) eps relative
        # to the largest advantage (tests/tolerances.py)
        np.testing.assert_allclose(got, ref, rtol=0, atol=sum_tol(2 * g + 4, np.abs(ref).max()))
        assert (got[0] == 0).all()
        lengths = rng.integers(1, 13, size=(n, g))
        for buf, factor in ((4, 1.0), (12, 0.5), (1, 2.0)):
            got = adv.overlong_penalty(lengths, max_tokens=12, buffer=buf, factor=factor, xp=np)
            ref = adv.overlong_penalty(lengths, max_tokens=12, buffer=buf, factor=factor)
            assert got.dtype == np.float32
            # elementwise: a subtraction, a division and a product, each eps/2
            np.testing.assert_allclose(got, np.asarray(ref), rtol=2 * F32_EPS)
        trunc = rng.random((n, g)) < 0.3
        np.testing.assert_array_equal(adv.zero_truncated_rewards(r, trunc, xp=np),
                                      np.asarray(adv.zero_truncated_rewards(r, trunc)))
        np.testing.assert_array_equal(adv.groups_with_signal(r, xp=np),
                                      np.asarray(adv.groups_with_signal(jnp.asarray(r))))
    bad = np.ones((2, 3), np.float32)
    bad[1, 2] = np.nan
    for xp in (np, jnp):
        with pytest.raises(ValueError, match="group 1, sample 2"):
            adv.group_advantages(bad, estimator=estimator, scale_by_std=scale, xp=xp)


def test_host_positions_equal_positions_from_mask():
    from rlflow.learner.batch import host_positions
    from rlflow.models.decoder import positions_from_mask

    rng = np.random.default_rng(0)
    mask = np.zeros((16, 12), bool)
    for i in range(16):
        a = rng.integers(0, 12)
        mask[i, a:rng.integers(a, 13)] = True
    got = host_positions(mask)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(positions_from_mask(mask)))


def _row_oracle(records, keep, adv, shaped, b_rows, seq, pad=0):
    """Plain per-row loop (the layout of the module docstring), for the vectorised builder."""
    g = len(records[0]["rewards"])
    p_max = max(len(r["prompt_tokens"]) for r in records)
    out = {k: np.zeros((b_rows, seq), t) for k, t in
           (("tokens", np.int32), ("attn", bool), ("loss", bool), ("mu", np.float32),
            ("adv", np.float32), ("rew", np.float32))}
    out["attn"][:, 0] = True
    for i, rec in enumerate(records):
        p = list(rec["prompt_tokens"])
        for s in range(g):
            row, n = i * g + s, int(rec["completion_lengths"][s])
            seq_toks = p + list(rec["completion_tokens"][s, :n])
            start = p_max - len(p)
            out["tokens"][row, start:start + len(seq_toks)] = seq_toks
            out["attn"][row] = False
            out["attn"][row, start:start + len(seq_toks)] = True
            for t in range(n):
                out["loss"][row, p_max - 1 + t] = keep[i, s]
                out["mu"][row, p_max - 1 + t] = rec["behaviour_logprobs"][s, t]
                out["adv"][row, p_max - 1 + t] = adv[i, s] if keep[i, s] else 0.0
            out["rew"][row, p_max - 2 + n] = shaped[i, s] if keep[i, s] else 0.0
    return out


def test_random_batch_matches_per_row_oracle():
    """Random prompts/completions of different widths, truncation, staleness drops and
    zero-variance groups: every array equals the per-row loop."""
    from rlflow.learner import advantages as adv

    rng = np.random.default_rng(7)
    g, n_rec = 4, 5
    recs = []
    for i in range(n_rec):
        width = int(rng.integers(3, 7))
        comps = [list(rng.integers(1, 50, size=rng.integers(1, width + 1))) for _ in range(g)]
        rewards = rng.integers(0, 2, size=g).astype(np.float32) if i != 2 else np.ones(g)
        versions = rng.integers(3, 6, size=g)
        recs.append(record(rng.integers(1, 50, size=rng.integers(1, 5)), comps, rewards,
                           truncated=rng.random(g) < 0.3, versions=versions, pid=i, width=width))
    sp = spec(group_size=g, num_rows=24, seq_buckets=(16,), estimator="grpo",
              mask_truncated=True, dynamic_sampling=True, max_staleness=1)
    batch, info = build_batch(recs, sp, learner_version=5)
    rewards = np.stack([r["rewards"] for r in recs]).astype(np.float32)
    stale = np.stack([5 - r["policy_versions"].max(axis=1) for r in recs])
    keep = (stale <= 1) & ~np.stack([r["truncated"] for r in recs]) & \
        (rewards.max(1) > rewards.min(1))[:, None]
    assert 0 < keep.sum() < keep.size
    a = np.asarray(adv.group_advantages(rewards, estimator="grpo"))
    want = _row_oracle(recs, keep, a, rewards, 24, 16)
    np.testing.assert_array_equal(batch.tokens, want["tokens"])
    np.testing.assert_array_equal(batch.attention_mask, want["attn"])
    np.testing.assert_array_equal(batch.loss_mask, want["loss"])
    np.testing.assert_array_equal(batch.behaviour_logprobs, want["mu"])
    np.testing.assert_allclose(batch.advantages, want["adv"], rtol=0,
                               atol=sum_tol(2 * g + 4, np.abs(want["adv"]).max()))
    np.testing.assert_array_equal(batch.token_rewards, want["rew"])
    np.testing.assert_array_equal(batch.targets[:, :-1], want["tokens"][:, 1:])
    assert info["batch/loss_samples"] == keep.sum()


def test_every_sample_failed_skips_the_step_as_all_failed():
    """Issue 44.7: a step whose samples were all cut by failures (mask) trains nothing; the
    skip names the reason."""
    from rlflow.exchange.records import synthetic_group
    from rlflow.learner.skips import explain, skip_reason

    recs = [synthetic_group(np.random.default_rng(i), group_size=2, max_tokens=4)
            for i in range(2)]
    for r in recs:
        r["failed"] = np.ones(2, bool)
    spec = BatchSpec(group_size=2, num_rows=4, seq_buckets=(16,), max_tokens=4)
    batch, info = build_batch(recs, spec, learner_version=0)
    assert info["batch/failed_samples"] == 4 and not batch.loss_mask.any()
    assert skip_reason(info) == "all_failed"
    assert "learner.on_failed_sample='mask'" in explain("all_failed", ExperimentConfig())
    _, kept = build_batch(recs, spec.replace(on_failed_sample="zero_reward"), learner_version=0)
    assert kept["batch/loss_samples"] == 4 and kept["batch/failed_samples"] == 4
