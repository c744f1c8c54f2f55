"""Rollout correction and mismatch diagnostics (rlflow.learner.rollout_correction) against
plain numpy oracles: every level x mode on packed rows with a multi-turn mask, every
diagnostic split by policy lag, the corrected loss of a train step, and a perturbed sampler
whose mismatch the diagnostics see and the rejection mask removes."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlflow.config import MeshConfig, ModelConfig, RolloutCorrectionConfig as RC
from rlflow.learner import losses
from rlflow.learner import rollout_correction as rc
from rlflow.learner.batch import BatchSpec, TrainBatch, build_batch, with_sequence_ids
from rlflow.learner.packing import PackSpec, pack_batch
from rlflow.learner.step import StepSettings, make_grad_fn, policy_logprobs
from rlflow.mesh import make_mesh
from rlflow.run.metrics import LAG_BUCKETS
from rlflow.models.hf import build_model
from learner_fixtures import make_group_records
from tolerances import F32_EPS, MIXED_SIGN_CANCEL, model_chain_len, reorder_rtol, sum_tol

VOCAB, G, T = 64, 4, 6
MODEL = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8)
SPEC = BatchSpec(group_size=G, num_rows=8, seq_buckets=(16,), max_tokens=T, max_staleness=2)


# ----------------------------------------------------------------------------- oracles

def np_level(lr, mask, seg, level):
    """Per token: its log-ratio, its sequence's sum, or its sequence's mean (float64)."""
    lr = np.where(mask, lr.astype(np.float64), 0.0)
    if level == "token":
        return lr
    out = np.zeros_like(lr)
    for s in np.unique(seg[mask]):
        sel = (seg == s) & mask
        out[sel] = lr[sel].sum() / (sel.sum() if level == "geometric" else 1)
    return out


def np_spread(flag, mask, ids):
    """True on the masked tokens of every id that holds a flagged token."""
    out = np.zeros_like(mask)
    for i in np.unique(ids[flag]):
        out |= (ids == i) & mask
    return out


def np_correct(lr, mask, seg, grp, cfg):
    """``(weight, keep, rejected, truncated)`` as the rollout-correction config defines them."""
    if cfg.weight == "off":
        w, trunc = np.ones(lr.shape), np.zeros(lr.shape, bool)
    else:
        lw = np_level(lr, mask, seg, cfg.weight)
        lo = np.log(cfg.weight_floor) if cfg.weight_floor else -np.inf
        w = np.exp(np.clip(lw, lo, np.log(cfg.weight_cap)))
        trunc = mask & ((lw > np.log(cfg.weight_cap)) | (lw < lo))
    if cfg.reject == "off":
        rej = np.zeros(lr.shape, bool)
    else:
        lw = np_level(lr, mask, seg, cfg.reject)
        ok = np.ones(lr.shape, bool)
        if cfg.reject_low:
            ok &= lw >= np.log(cfg.reject_low)
        if cfg.reject_high:
            ok &= lw <= np.log(cfg.reject_high)
        fail = mask & ~ok
        rej = {"token": fail, "sequence": np_spread(fail, mask, seg),
               "group": np_spread(fail, mask, grp)}[cfg.unit]
    keep = mask & ~rej
    return np.where(keep, w, 0.0), keep, rej, trunc


def np_diagnostics(old, mu, mask, seg, lag, rejected, truncated):
    """The step's mismatch metrics, from their definitions, sequence by sequence (float64)."""
    d = old.astype(np.float64) - mu
    bucket = np.minimum(lag, len(LAG_BUCKETS) - 1)
    out = {}
    for suffix, sel_b in [("", mask)] + [(f"_{b}", mask & (bucket == i))
                                         for i, b in enumerate(LAG_BUCKETS)]:
        dt = d[sel_b]
        seqs = [s for s in np.unique(seg[sel_b])]
        n_t, n_s = max(dt.size, 1), max(len(seqs), 1)
        per_seq = [d[(seg == s) & mask] for s in seqs]
        out |= {f"mismatch/kl_k1{suffix}": np.sum(-dt) / n_t,
                f"mismatch/kl_k3{suffix}": np.sum(np.exp(dt) - 1 - dt) / n_t,
                f"mismatch/chi2{suffix}": np.sum(np.exp(2 * dt) - 1) / n_t,
                f"mismatch/log_ppl_diff{suffix}": sum(-x.mean() for x in per_seq) / n_s,
                f"rollout_correction/masked_token_frac{suffix}": rejected[sel_b].sum() / n_t,
                f"rollout_correction/truncated_token_frac{suffix}": truncated[sel_b].sum() / n_t,
                f"rollout_correction/masked_seq_frac{suffix}":
                    sum(rejected[(seg == s) & mask].any() for s in seqs) / n_s,
                f"rollout_correction/truncated_seq_frac{suffix}":
                    sum(truncated[(seg == s) & mask].any() for s in seqs) / n_s}
    return out


# ---------------------------------------------------------------- packed multi-turn rows

def packed_rows(seed=0):
    """4 rows of 14 positions holding 7 sequences (2 per row, one alone), ids unique over
    the batch, 3 groups, lags 0..3; sequences 2 and 5 are multi-turn (environment tokens
    inside, mask 0); log-ratios of mixed size."""
    rng = np.random.default_rng(seed)
    seg = np.array([[1] * 6 + [2] * 7 + [0],
                    [3] * 9 + [4] * 4 + [0],
                    [5] * 14,
                    [6] * 5 + [7] * 5 + [0] * 4], np.int32)
    group = {1: 1, 2: 1, 3: 2, 4: 3, 5: 2, 6: 3, 7: 1}
    lag_of = {1: 0, 2: 0, 3: 1, 4: 2, 5: 1, 6: 3, 7: 0}
    mask = seg > 0
    mask[seg != np.roll(seg, 1, axis=1)] = False          # each sequence's prompt token
    mask[0, 8:10] = False                                 # sequence 2: environment tokens
    mask[2, 4:7] = False                                  # sequence 5: environment tokens
    grp = np.vectorize(lambda s: group.get(s, 0))(seg).astype(np.int32)
    lag = np.vectorize(lambda s: lag_of.get(s, 0))(seg).astype(np.int32)
    old = (-2.0 + rng.normal(scale=0.5, size=seg.shape)).astype(np.float32)
    lr = rng.normal(scale=0.4, size=seg.shape) * rng.choice([0.05, 1.0, 3.0], size=seg.shape)
    mu = (old - lr).astype(np.float32)
    mu[~mask] = np.nan                                     # never read: masked
    return old, mu, mask, seg, grp, lag


LEVELS = ("token", "sequence", "geometric")
CAPS = {"token": ((1.5, 0.0), (1.2, 0.8)), "sequence": ((2.0, 0.0), (1.6, 0.5)),
        "geometric": ((1.2, 0.0), (1.1, 0.8))}        # (cap, floor): each truncates some
CASES = ([RC(weight=lv, weight_cap=c, weight_floor=f) for lv in LEVELS for c, f in CAPS[lv]]
         + [RC(weight="off")]
         + [RC(weight="off", reject=lv, reject_low=lo, reject_high=hi, reject_unit=u)
            for lv, u, (lo, hi) in (("token", None, (0.5, 2.0)), ("token", "sequence", (0.3, 3.0)),
                                    ("token", "group", (0.22, 3.5)),
                                    ("sequence", None, (0.3, 3.0)),
                                    ("sequence", "group", (0.3, 3.0)),
                                    ("geometric", None, (0.9, 1.1)),
                                    ("geometric", "group", (0.77, 1.3)))]
         + [RC(weight="sequence", weight_cap=2.0, reject="geometric", reject_low=0.8,
               reject_high=1.25)])


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"w={c.weight}/r={c.reject}/{c.unit}")
def test_correction_matches_numpy_oracle(cfg):
    old, mu, mask, seg, grp, _ = packed_rows()
    lr = np.where(mask, old - np.nan_to_num(mu), 0.0).astype(np.float32)
    got = rc.correct(jnp.asarray(old) - jnp.asarray(mu), mask, cfg, segment_ids=seg,
                     group_ids=grp)
    w, keep, rej, trunc = np_correct(lr, mask, seg, grp, cfg)
    # a float32 sum over a sequence's <= 14 log-ratios (scale: their absolute sum) against
    # float64; exp turns that absolute error into a relative one of the weight
    scale = float(np.abs(lr).sum(axis=1).max()) + 1.0
    np.testing.assert_allclose(got.weight, w, rtol=sum_tol(14, scale))
    # no level value lies within that error of a threshold, so the masks are exact
    thresholds = np.log([v for v in (cfg.weight_cap, cfg.weight_floor, cfg.reject_low,
                                     cfg.reject_high) if v > 0])
    for lv in {cfg.weight, cfg.reject} - {"off"}:
        margin = np.abs(np_level(lr, mask, seg, lv)[mask][:, None] - thresholds).min()
        assert margin > sum_tol(14, scale), (lv, margin)
    np.testing.assert_array_equal(got.keep, keep)
    np.testing.assert_array_equal(got.rejected, rej)
    np.testing.assert_array_equal(got.truncated, trunc)
    if cfg.weight != "off":
        assert trunc.any()                                 # the cap / floor truncated some
    if cfg.reject != "off":
        assert rej.any() and keep.any()                    # the band rejected some, not all
    if cfg.unit != "token" and cfg.reject != "off":        # whole units only
        for ids in (seg, grp) if cfg.unit == "group" else (seg,):
            for i in np.unique(ids[mask]):
                assert len(np.unique(rej[(ids == i) & mask])) == 1


def test_weight_saturates_and_nonfinite_gives_zero():
    lr = np.log(np.array([10.0, 0.1], np.float32))
    # exp(x) of an x rounded once to float32 (the log, or log(cap) / log(floor)): relative
    # error |x| u from x plus exp's own rounding, within (max |x| + 1) eps
    rtol = sum_tol(1, 1 + float(np.max(np.abs(lr))))
    np.testing.assert_allclose(rc.truncated_weight(lr, cap=2.0, floor=0.5), [2.0, 0.5],
                               rtol=rtol)
    np.testing.assert_allclose(rc.truncated_weight(lr, cap=2.0), [2.0, 0.1], rtol=rtol)
    np.testing.assert_allclose(rc.truncated_weight([1000.0, np.nan], cap=2.0), [2.0, 0.0],
                               rtol=rtol)
    # a sequence-level log-weight of 1000 (the product overflows) truncates to the cap
    c = rc.correct(np.full((1, 4), 250.0, np.float32), np.ones((1, 4), bool),
                   RC(weight="sequence", weight_cap=5.0))
    np.testing.assert_allclose(c.weight, np.full((1, 4), 5.0), rtol=sum_tol(1, 2.0))
    assert bool(c.truncated.all())


def test_diagnostics_match_numpy_oracle_and_split_over_rows():
    """Every diagnostic, for the batch and per lag bucket, against the oracle; the sums of
    two halves of the rows (micro-batches, shards) add up to those of the whole."""
    old, mu, mask, seg, grp, lag = packed_rows(1)
    cfg = RC(weight="geometric", weight_cap=1.13, weight_floor=0.7, reject="token", reject_low=0.4,
             reject_high=2.5, reject_unit="sequence")
    corr = rc.correct(jnp.asarray(old) - jnp.asarray(mu), mask, cfg, segment_ids=seg,
                      group_ids=grp)
    sums = rc.mismatch_sums(old, mu, mask, corr, segment_ids=seg, policy_lag=lag)
    got = {k: float(v) for k, v in rc.mismatch_metrics(sums).items()}
    want = np_diagnostics(old, np.nan_to_num(mu), mask, seg, lag, np.asarray(corr.rejected),
                          np.asarray(corr.truncated))
    assert set(got) == set(want)
    d = np.where(mask, old - np.nan_to_num(mu), 0.0)
    # float32 sums of <= 56 terms; exp(2 d) terms reach exp(2 max |d|) (chi-square's scale)
    scale = float(np.exp(2 * np.abs(d).max()) + 1.0)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=sum_tol(2 * 56, scale),
                                   err_msg=k)
    assert all(want[f"mismatch/kl_k3_{b}"] > 0 for b in LAG_BUCKETS)       # every bucket used
    assert 0 < want["rollout_correction/masked_seq_frac"] < 1
    assert 0 < want["rollout_correction/truncated_seq_frac"] < 1
    halves = [rc.mismatch_sums(old[r], mu[r], mask[r], rc.Correction(*(x[r] for x in corr)),
                               segment_ids=seg[r], policy_lag=lag[r])
              for r in (slice(0, 2), slice(2, 4))]
    for k in sums:
        np.testing.assert_allclose(halves[0][k] + halves[1][k], sums[k], rtol=0,
                                   atol=sum_tol(56, scale), err_msg=k)


def test_micro_batch_ids_beyond_its_size():
    """A micro-batch's segment ids run over its whole batch (here up to 100 x its size):
    with the whole batch's ``num_segments`` the correction and sums are those of small ids."""
    old, mu, mask, seg, grp, lag = packed_rows(3)
    cfg = RC(weight="sequence", weight_cap=1.5, reject="geometric", reject_low=0.8,
             reject_high=1.25)
    big = np.where(seg > 0, seg + 100 * seg.size, 0)
    n = 101 * seg.size + 1
    for ids, num in ((seg, None), (big, n)):
        c = rc.correct(old - mu, mask, cfg, segment_ids=ids, num_segments=num)
        sums = rc.mismatch_sums(old, mu, mask, c, segment_ids=ids, policy_lag=lag,
                                num_segments=num)
        if num is None:
            want = (c, sums)
            continue
        for a, b in zip(c, want[0]):
            np.testing.assert_array_equal(a, b)
        for k in sums:
            np.testing.assert_array_equal(sums[k], want[1][k], err_msg=k)
    assert bool(want[0].rejected.any()) and bool(want[0].truncated.any())


def test_kl_estimators_are_the_loss_module_s():
    """The k1 / k3 diagnostics are losses.kl_penalty with the behaviour policy as the
    sampled one (KL(mu || pi_old)): one implementation of the estimator."""
    old, mu, mask, seg, _, lag = packed_rows(2)
    mu = np.nan_to_num(mu)
    corr = rc.correct(old - mu, mask, RC())
    sums = rc.mismatch_sums(old, mu, mask, corr, segment_ids=seg, policy_lag=lag)
    for est in ("k1", "k3"):
        want = float(jnp.sum(losses.kl_penalty(mu, old, mask, est)))
        np.testing.assert_allclose(float(sums[f"kl_{est}"].sum()), want,
                                   rtol=sum_tol(56, 4.0))


# ----------------------------------------------------------------- the train step's loss

@pytest.fixture(scope="module")
def tiny():
    """``(graphdef, params, forward)``: a tiny random model and its jitted forward
    ``batch -> (logits [B, L, V], logprobs of the targets [B, L])``."""
    graphdef, params = nnx.split(build_model(MODEL)[0], nnx.Param)

    @jax.jit
    def forward(batch):
        model = nnx.merge(graphdef, params)
        hidden = model.hidden_states(batch.tokens, batch.positions, batch.attention_mask,
                                     segment_ids=batch.segment_ids,
                                     prefix_ids=batch.prefix_ids).hidden
        return model.project(hidden), policy_logprobs(graphdef, params, batch)[0]

    return graphdef, params, forward


def perturbed_batch(forward, sigma, perturbed_rows, seed=0, packed=False):
    """A batch of 2 groups (learner version 1: group 0 sampled at version 1, lag 0; group 1
    at version 0, lag 1) whose behaviour logprobs are the model's own, except on
    ``perturbed_rows``, sampled from logits + ``sigma`` x fixed Gaussian noise (a sampler
    that differs from the learner there; ``sigma`` a number, or one per perturbed row).
    Returns ``(batch, learner logprobs)``."""
    recs = (make_group_records(seed, 1, vocab=VOCAB, group_size=G, max_tokens=T, version=1)
            + make_group_records(seed + 1, 1, vocab=VOCAB, group_size=G, max_tokens=T,
                                 version=0))
    batch, _ = build_batch(recs, SPEC, 1)
    batch = with_sequence_ids(batch)
    logits = np.asarray(forward(TrainBatch(*batch))[0], np.float64)
    noise = np.random.default_rng(99).normal(size=logits.shape)
    rows = np.zeros(logits.shape[0])
    rows[perturbed_rows] = sigma
    z = logits + noise * rows[:, None, None]

    def log_softmax_at(z):
        z = z - z.max(-1, keepdims=True)
        lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        return np.take_along_axis(lp, batch.targets[..., None], -1)[..., 0]

    mu = np.where(batch.loss_mask, log_softmax_at(z), 0.0).astype(np.float32)
    batch = batch._replace(behaviour_logprobs=mu)
    if packed:
        spec = PackSpec.create(num_rows=SPEC.num_rows, max_row=16, pack_length=32, buckets=1,
                               split=2, shared_prefix=True)
        batch, _ = pack_batch(batch._replace(segment_ids=None, prefix_ids=None), spec)
        batch = with_sequence_ids(batch)
    return batch, np.asarray(forward(TrainBatch(*batch))[1])


STEP_CASES = [                         # (off_policy, micro-batches, packed, correction)
    ("decoupled", 1, False, RC(weight="sequence", weight_cap=1.5, reject="geometric",
                               reject_low=0.95, reject_high=1.05)),
    ("decoupled", 2, True, RC(weight="token", weight_cap=1.05, reject="token", reject_low=0.5,
                              reject_high=2.0, reject_unit="group")),
    ("behaviour", 2, False, RC(reject="sequence", reject_low=0.85, reject_high=1.3)),
]


@pytest.mark.parametrize("off_policy, k, packed, cfg", STEP_CASES,
                         ids=["seq-weight+geo-mask", "group-mask-2-micro-packed",
                              "behaviour+seq-mask"])
def test_step_loss_equals_corrected_objective(tiny, off_policy, k, packed, cfg):
    """The loss of one step with the correction on equals the numpy oracle of the corrected
    objective (seq-mean-token-mean GRPO loss, no KL): with one optimiser step per batch the
    decoupled ratio is 1, so the loss is ``-sum_t agg_t w_t A_t`` over kept tokens; the
    behaviour mode clips ``pi / mu``. The step's diagnostics equal the oracle's too."""
    graphdef, params, forward = tiny
    # sample 1 slightly off (weighted; kept by the group band), samples 5 and 6 far off
    batch, logp = perturbed_batch(forward, [0.05, 0.7, 0.7], [1, 5, 6], packed=packed)
    s = StepSettings(loss_agg="seq-mean-token-mean", norm_len=T, micro_batches=k,
                     off_policy=off_policy, correction=cfg)
    loss, _, stats = jax.jit(make_grad_fn(graphdef, s))(params, TrainBatch(*batch), None)
    mask, seg, grp = batch.loss_mask, batch.segment_ids, batch.group_ids
    lr = np.where(mask, logp - batch.behaviour_logprobs, 0.0)
    w, keep, rej, trunc = np_correct(lr, mask, seg, grp, cfg)
    agg = np.asarray(losses.loss_weights(mask, "seq-mean-token-mean", segment_ids=seg))
    adv = batch.advantages.astype(np.float64)
    if off_policy == "decoupled":
        per_tok = w * -adv
    else:
        r = np.exp(lr)
        per_tok = np.maximum(-adv * r, -adv * np.clip(r, 0.8, 1.2 + 0.08))
    want = float(np.sum(np.where(keep, agg * per_tok, 0.0)))
    assert rej.any() and keep.any()
    if cfg.unit == "group":
        assert set(np.unique(grp[rej])) == {1, 2} - set(np.unique(grp[keep]))
    chain, n = model_chain_len(MODEL, batch.tokens.shape[1]), int(mask.sum())
    # the oracle's logprobs come from another forward program (see tests/tolerances.py); the
    # loss is a mixed-sign sum (zero-mean advantages): bound relative to its absolute terms
    scale = float(np.sum(np.where(keep, np.abs(agg * per_tok), 0.0)))
    np.testing.assert_allclose(float(loss), want, rtol=0, atol=reorder_rtol(chain, n) * scale)
    assert abs(want) > 10 * reorder_rtol(chain, n) * scale
    got = {k: float(v) for k, v in rc.mismatch_metrics(
        {n: stats[f"mismatch/{n}"] for n in rc.DIAGNOSTIC_SUMS}).items()}
    want_d = np_diagnostics(logp, batch.behaviour_logprobs, mask, seg, batch.policy_lag,
                            rej, trunc)
    for key in want_d:
        np.testing.assert_allclose(got[key], want_d[key], rtol=reorder_rtol(chain, n),
                                   atol=2 * chain * F32_EPS, err_msg=key)


def test_perturbed_sampler_raises_diagnostics_and_is_rejected(tiny):
    """Behaviour logprobs from the same model with logit noise on samples 1, 5 and 6: the
    diagnostics rise with the noise, in the lag buckets those samples are in; a token-level
    band with sequence unit rejects exactly those samples, at every noise level > 0."""
    graphdef, params, forward = tiny
    perturbed = [1, 5, 6]                           # sample 1: lag 0; samples 5, 6: lag 1
    cfg = RC(reject="token", reject_low=np.exp(-1e-3), reject_high=np.exp(1e-3),
             reject_unit="sequence")
    grad_fn = jax.jit(make_grad_fn(graphdef, StepSettings(norm_len=T, correction=cfg)))
    seen = []
    for sigma in (0.0, 0.3, 1.0, 3.0):
        batch, logp = perturbed_batch(forward, sigma, perturbed)
        _, _, stats = grad_fn(params, TrainBatch(*batch), None)
        m = {k: float(v) for k, v in rc.mismatch_metrics(
            {n: stats[f"mismatch/{n}"] for n in rc.DIAGNOSTIC_SUMS}).items()}
        seen.append(m)
        corr = rc.correct(logp - batch.behaviour_logprobs, batch.loss_mask, cfg,
                          segment_ids=batch.segment_ids)
        rejected_rows = set(np.flatnonzero(np.asarray(corr.rejected).any(axis=1)))
        assert rejected_rows == (set(perturbed) if sigma else set()), sigma
        # sequence counts are token sums of 1 / |seq| (<= 24 float32 terms, each rounded)
        np.testing.assert_allclose(m["rollout_correction/masked_seq_frac"],
                                   3 / 8 if sigma else 0.0, rtol=0, atol=sum_tol(2 * 24))
        np.testing.assert_allclose(m["rollout_correction/masked_seq_frac_lag1"],
                                   2 / 4 if sigma else 0.0, rtol=0, atol=sum_tol(2 * 24))
    # unperturbed: the two forwards agree to rounding (chain x eps per log-ratio)
    tol = 2 * model_chain_len(MODEL, 16) * F32_EPS * 5.0
    for key in ("mismatch/kl_k3", "mismatch/chi2", "mismatch/kl_k1"):
        assert abs(seen[0][key]) < tol, (key, seen[0][key])
    # k3 >= 0 per token, growing with |log rho|: it rises with the noise, in both buckets
    for key in ("mismatch/kl_k3", "mismatch/kl_k3_lag0", "mismatch/kl_k3_lag1"):
        vals = [m[key] for m in seen]
        assert all(a < b for a, b in itertools.pairwise(vals)), (key, vals)
    # chi-square and the log-perplexity gap are means over tokens the sampler did not draw
    # (random tokens), so only their size is certain to grow
    for key in ("mismatch/chi2", "mismatch/log_ppl_diff", "mismatch/kl_k1"):
        assert abs(seen[-1][key]) > 1000 * tol, (key, seen[-1][key])
    assert seen[-1]["mismatch/kl_k3_lag2plus"] == 0.0             # an empty bucket


def test_group_rejection_sharded_equals_single_device(tiny):
    """Group rejection over 2 micro-batches (the start pass) on 4 fake devices (batch on
    fsdp) equals one device: loss and every diagnostic sum."""
    graphdef, params, forward = tiny
    batch, _ = perturbed_batch(forward, 0.7, [1, 5, 6])
    s = StepSettings(loss_agg="seq-mean-token-mean", norm_len=T, micro_batches=2,
                     correction=RC(weight="geometric", weight_cap=1.1, reject="token",
                                   reject_low=0.5, reject_high=2.0, reject_unit="group"))
    mesh = make_mesh(MeshConfig(fsdp=4), jax.devices()[:4])
    out = [jax.jit(make_grad_fn(graphdef, s, m))(params, TrainBatch(*batch), None)
           for m in (None, mesh)]
    (l1, _, s1), (l4, _, s4) = out
    chain, n = model_chain_len(MODEL, batch.tokens.shape[1]), int(batch.loss_mask.sum())
    np.testing.assert_allclose(float(l4), float(l1), rtol=reorder_rtol(chain, n,
                                                                         MIXED_SIGN_CANCEL))
    for k in s1:
        if k.startswith("mismatch/"):
            np.testing.assert_allclose(np.asarray(s4[k]), np.asarray(s1[k]),
                                       rtol=reorder_rtol(chain, n),
                                       atol=2 * chain * F32_EPS * n, err_msg=k)
    assert float(s1["mismatch/masked_tokens"].sum()) > 0
