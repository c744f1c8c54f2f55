"""Adapter-only weight sync on the sampler: after a swap of adapters alone, the sampler's
logprobs equal the learner's recompute (the LoRA decoder on the same base), for sequences
in flight across the swap and for new requests, with the adapters applied in the forward
("forward") or merged into a working copy of the kernels ("merged", never accumulating)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlflow.config import MeshConfig, ModelConfig, SamplerConfig
from rlflow.mesh import make_mesh
from rlflow.models import build_model
from rlflow.models.logprobs import token_logprobs
from rlflow.models.lora import LoraSpec, tree_bytes
from rlflow.sampler.batching import ContinuousBatcher, Request
from rlflow.sampler.engine import RlflowEngine
from rlflow.sampler.lora_swap import AdapterApplier
from rlflow.sampler.sampling import SamplingParams
from tolerances import F32_EPS, forward_atol

VOCAB = 128
PROMPT = [1, 20, 33, 47]
# One layer and no q/k/v adapters: the keys/values do not depend on the adapters, so a
# sequence whose KV cache mixes two versions equals the learner's recompute of either.
SPEC = LoraSpec(rank=4, alpha=8.0, projections=("o_proj", "gate_proj", "up_proj", "down_proj"))


def _adapters(target, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(scale=0.5, size=x.shape), x.dtype),
                        target)


@pytest.fixture(scope="module", params=["forward", "merged"])
def setup(request):
    model, dcfg = build_model(ModelConfig(vocab_size=VOCAB, tie_word_embeddings=False,
                                          num_layers=1, init_seed=1))
    nnx.update(model, jax.tree.map(lambda x: x * 6.0, nnx.state(model, nnx.Param)))
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    applier = AdapterApplier(model, dcfg, SPEC, request.param, mesh)
    cfg = SamplerConfig(num_slots=4, max_prefill_length=8, prefill_buckets=(8,),
                        max_tokens=6, temperature=1.0, decode_steps_per_call=1)
    engine = RlflowEngine(applier.engine_model, cfg, mesh=mesh)
    gd, base = applier.graphdef, applier.base
    learner_fwd = jax.jit(lambda ad, t, p, m: nnx.merge(gd, ad, base)(t, p, m))
    return applier, engine, learner_fwd


def _recompute(fwd, adapters, seq, n_prompt):
    t = jnp.asarray([seq], jnp.int32)
    n = t.shape[1]
    logits = fwd(adapters, t, jnp.arange(n)[None], jnp.ones((1, n), bool))[0]
    return np.asarray(token_logprobs(logits[n_prompt - 1:-1], jnp.asarray(seq[n_prompt:])))


def test_adapter_swap_in_flight_and_new_requests_match_the_learner(setup):
    applier, engine, fwd = setup
    v0, v1 = _adapters(applier.target, 0), _adapters(applier.target, 1)
    full = tree_bytes(applier.base)
    assert tree_bytes(v1) < full / 10          # what goes over the wire per version
    batcher = ContinuousBatcher(engine, params=applier.engine_params(v0), version=0)
    # 5 samples on 4 slots: sample 4 waits in the queue across the swap (a new request)
    batcher.submit(Request(3, PROMPT, 5, SamplingParams(temperature=1.0, max_tokens=6, seed=7,
                                                        stop_token_ids=())))
    batcher.step()
    batcher.step()
    batcher.update_params(applier.engine_params(v1), version=1)
    groups = []
    while batcher.has_work:
        groups += batcher.step()
    comps = groups[0].completions
    # float32: logprobs are O(10) sums of length-<=128 contractions -> ~ 128 * 10 * eps
    tol = 128 * 10 * float(np.finfo(np.float32).eps)
    p = len(PROMPT)
    for c in comps[:4]:                                   # in flight across the swap
        assert c.versions.tolist() == [0, 0, 1, 1, 1, 1]
        seq = PROMPT + c.tokens.tolist()
        lp0, lp1 = _recompute(fwd, v0, seq, p), _recompute(fwd, v1, seq, p)
        np.testing.assert_allclose(c.logprobs[:2], lp0[:2], atol=tol, rtol=0)
        np.testing.assert_allclose(c.logprobs[2:], lp1[2:], atol=tol, rtol=0)
        assert np.abs(lp0[2:] - lp1[2:]).max() > 100 * tol        # the versions differ
    new = comps[4]                                         # admitted after the swap
    assert (new.versions == 1).all()
    np.testing.assert_allclose(new.logprobs, _recompute(fwd, v1, PROMPT + new.tokens.tolist(),
                                                        p), atol=tol, rtol=0)


def test_repeated_swaps_do_not_accumulate(setup):
    """base + delta(v) each time: v0 -> v1 -> v0 gives v0's parameters bit for bit."""
    applier, _, _ = setup
    v0, v1 = _adapters(applier.target, 0), _adapters(applier.target, 1)
    first = jax.tree.leaves(applier.engine_params(v0))
    applier.engine_params(v1)
    again = jax.tree.leaves(applier.engine_params(v0))
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the base arrays are shared, not copied (merged: all but the 4 adapted kernels)
    base, ids = jax.tree.leaves(applier.base), {id(x) for x in first}
    shared = sum(id(x) in ids for x in base)
    assert shared == len(base) - (4 if applier.mode == "merged" else 0)


@pytest.mark.parametrize("mode", ["forward", "merged"])
def test_trained_embeddings_and_final_norm_reach_the_engine(mode):
    """learner.lora.train_embeddings / train_final_norm on a tied base: the engine parameters
    of a version give the learner's logits (the trained embedding on the input and output
    side), the trained modules replace the base's, and the base is never modified."""
    model, dcfg = build_model(ModelConfig(vocab_size=VOCAB, num_layers=1, init_seed=2))
    spec = LoraSpec(rank=4, alpha=8.0, projections=("q_proj", "down_proj"),
                    train_final_norm=True, train_embeddings=True)
    applier = AdapterApplier(model, dcfg, spec, mode)
    assert set(applier.target.to_pure_dict()) == {"layers", "embed", "final_norm"}   # tied
    embed0 = np.asarray(model.embed[...]).copy()
    version = _adapters(applier.target, 3)
    params = applier.engine_params(version)
    engine_gd = nnx.split(applier.engine_model, nnx.Param)[0]
    toks = jnp.asarray([PROMPT + [5, 9]], jnp.int32)
    pos, mask = jnp.arange(toks.shape[1])[None], jnp.ones(toks.shape, bool)
    got = np.asarray(nnx.merge(engine_gd, params)(toks, pos, mask))
    want = np.asarray(nnx.merge(applier.graphdef, version, applier.base)(toks, pos, mask))
    # same parameters, the adapter term merged or not: twice the forward chain plus the rank-r
    # contraction of the 2 adapted projections (tests/tolerances.py) at the logits' scale
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=forward_atol(dcfg, toks.shape[1], scale)
                               + 2 * 2 * spec.rank * F32_EPS * scale)
    np.testing.assert_array_equal(np.asarray(params["embed"][...]),
                                  np.asarray(version["embed"][...]))
    np.testing.assert_array_equal(np.asarray(model.embed[...]), embed0)    # base untouched
