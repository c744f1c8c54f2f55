"""Rollout routing replay in the model (issue 40 item 3; Ma et al. 2025, arXiv 2510.11370):
the replayed MoE layer against a numpy oracle (forced ids -> those experts with the learner's
renormalised gates), gradients reaching the router under replay, the decoder's per-layer
plumbing against a plain loop over its blocks, and the router agreement against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlflow.models import init_cache, positions_from_mask
from rlflow.models.config import DecoderConfig
from rlflow.models.decoder import Decoder, rope_inv_freq
from rlflow.models.layer_scan import layer_modules
from rlflow.models.attention import SequenceMask
from rlflow.models.moe import MoE, route
from rlflow.models.moe_replay import agreement_sums
from tolerances import forward_atol, sum_tol

N_EXPERTS, TOP_K = 8, 2
CFG = DecoderConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                    num_experts=N_EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=16,
                    norm_topk_prob=True)


def _forced_ids(rng, shape):
    """Distinct random expert ids ``shape + (k,)``."""
    return np.argsort(rng.random(shape + (N_EXPERTS,)), -1)[..., :TOP_K].astype(np.int8)


def _np_moe(x, w_router, wg, wu, wd, ids, norm):
    """Plain float64 oracle of one MoE layer routed to ``ids`` (-1 rows: own top-k)."""
    z = x @ w_router
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    own = np.argsort(-p, -1, kind="stable")[:, :TOP_K]
    ids = np.where((ids >= 0).all(-1, keepdims=True), ids, own)
    g = np.take_along_axis(p, ids, -1)
    g = g / g.sum(-1, keepdims=True) if norm else g
    silu = lambda a: a / (1 + np.exp(-a))                                  # noqa: E731
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            i = ids[t, j]
            y[t] += g[t, j] * ((silu(x[t] @ wg[i]) * (x[t] @ wu[i])) @ wd[i])
    return y


@pytest.mark.parametrize("norm", [False, True])
def test_replayed_moe_layer_equals_numpy_oracle_with_the_learners_gates(norm):
    cfg = DecoderConfig(**{**CFG.__dict__, "norm_topk_prob": norm})
    layer = MoE(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 7, 32)).astype(np.float32)
    ids = _forced_ids(rng, (2, 7))
    ids[1, 3] = -1                                        # no recorded choice: own top-k
    y, routing = layer(jnp.asarray(x), jnp.asarray(ids))
    w = [np.asarray(a[...], np.float64) for a in (layer.router, layer.gate_kernel,
                                                  layer.up_kernel, layer.down_kernel)]
    want = _np_moe(x.reshape(-1, 32).astype(np.float64), *w, ids.reshape(-1, TOP_K), norm)
    scale = np.abs(want).max() + np.abs(x).max()
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 32), want, rtol=0,
                               atol=sum_tol(32 + 16 + N_EXPERTS, scale))
    used = np.asarray(routing.expert_ids).reshape(2, 7, TOP_K)
    np.testing.assert_array_equal(np.delete(used.reshape(14, -1), 10, 0),
                                  np.delete(ids.reshape(14, -1), 10, 0))
    own = np.asarray(jax.lax.top_k(routing.probs, TOP_K)[1]).reshape(2, 7, TOP_K)
    np.testing.assert_array_equal(used[1, 3], own[1, 3])


def test_router_gradient_under_replay_equals_the_oracle_gradient():
    """R3 (the paper's eq. 5): the replayed mask is fixed, the gates are the learner's
    softmax at those ids, so the router gets the gradient of the gates (nonzero)."""
    layer = MoE(CFG, rngs=nnx.Rngs(4))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(9, 32)).astype(np.float32))
    ids = jnp.asarray(_forced_ids(rng, (9,)), jnp.int32)
    r = jnp.asarray(rng.normal(size=(9, 32)).astype(np.float32))
    graphdef, params = nnx.split(layer, nnx.Param)

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, p)(x, ids)[0] * r)

    def oracle(w_router):
        probs = jax.nn.softmax(x @ w_router, -1)
        g = jnp.take_along_axis(probs, ids, -1)
        g = g / g.sum(-1, keepdims=True)
        wg, wu, wd = (params[n][...] for n in ("gate_kernel", "up_kernel", "down_kernel"))
        h = jax.nn.silu(jnp.einsum("te,tkef->tkf", x, wg[ids])) * \
            jnp.einsum("te,tkef->tkf", x, wu[ids])
        return jnp.sum(jnp.einsum("tk,tkf,tkfe->te", g, h, wd[ids]) * r)

    got = np.asarray(jax.grad(loss)(params)["router"][...])
    want = np.asarray(jax.grad(oracle)(params["router"][...]))
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=sum_tol(32 * 16, np.abs(want).max()))


def _batch(seed=0, b=2, t=8):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 64, size=(b, t)).astype(np.int32)
    mask = np.ones((b, t), bool)
    mask[1, :2] = False                                   # left padding
    return tokens, positions_from_mask(mask), mask


def test_decoder_replays_each_layers_ids_like_a_plain_loop_over_blocks():
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    tokens, pos, mask = _batch()
    rng = np.random.default_rng(2)
    ids = _forced_ids(rng, (2, 8, 3))                     # [B, T, L, k]
    ids[0, 5] = -1                                        # one token without a record
    out = model.hidden_states(tokens, pos, mask, routing_ids=jnp.asarray(ids),
                              replay_routing=True)
    hidden, agreement = out.hidden, out.router_agreement
    assert out.aux_loss is None and out.logits is None       # not asked for
    # oracle: the blocks in a Python loop (no scan), layer l given ids[:, :, l]
    x = model._embed(tokens)
    attend = SequenceMask(jnp.asarray(mask), None, None, "auto", None)
    want_agree = np.zeros((3, 2))
    for l, block in enumerate(layer_modules(model.layers)):
        x, routing = block(x, pos, rope_inv_freq(CFG), attend, replay_ids=jnp.asarray(ids[:, :, l]),
                           return_routing=True)
        own = np.sort(np.asarray(jax.lax.top_k(routing.probs, TOP_K)[1]), -1)
        rec = ids[:, :, l].reshape(-1, TOP_K)
        counted = (rec >= 0).all(-1)
        want_agree[l] = [((own == np.sort(rec, -1)).all(-1) & counted).sum(), counted.sum()]
    want = np.asarray(model.final_norm(x))
    np.testing.assert_allclose(np.asarray(hidden), want, rtol=0,
                               atol=forward_atol(CFG, 8, np.abs(want).max()))
    np.testing.assert_array_equal(np.asarray(agreement), want_agree)
    assert (want_agree[:, 1] == 15).all()
    # replay changes the forward: forced ids differ from the router's own choice
    plain = model.hidden_states(tokens, pos, mask).hidden
    assert np.abs(np.asarray(plain) - np.asarray(hidden)).max() > 1e-3
    # without replay the recorded ids are only compared: the forward is the plain one
    out_off = model.hidden_states(tokens, pos, mask, routing_ids=jnp.asarray(ids))
    compared, agreement_off = out_off.hidden, out_off.router_agreement
    np.testing.assert_array_equal(np.asarray(compared), np.asarray(plain))
    assert np.all(np.asarray(agreement_off)[:, 1] == 15)


def test_replaying_the_models_own_cached_choice_changes_nothing_and_agrees_fully():
    """The ids ``forward_cached`` reports (what the sampler records) replayed in the full
    forward of the same float32 model: the same hidden states, agreement 1."""
    model = Decoder(CFG, rngs=nnx.Rngs(1))
    tokens, pos, mask = _batch(1)
    cache = init_cache(CFG, 2, 8)
    chosen = model.forward_cached(tokens, pos, mask, cache, jnp.zeros(2, jnp.int32),
                                  return_routing=True).expert_ids
    assert chosen.shape == (2, 8, 3, TOP_K) and chosen.dtype == jnp.int32
    chosen = jnp.where(jnp.asarray(mask)[:, :, None, None], chosen, -1)   # as recorded
    plain = model.hidden_states(tokens, pos, mask).hidden
    out = model.hidden_states(tokens, pos, mask, routing_ids=chosen, replay_routing=True)
    replayed, agreement = out.hidden, out.router_agreement
    np.testing.assert_array_equal(np.asarray(replayed)[mask], np.asarray(plain)[mask])
    np.testing.assert_array_equal(np.asarray(agreement), [[mask.sum()] * 2] * 3)


def test_dense_models_refuse_routing():
    dense = Decoder(DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8),
                    rngs=nnx.Rngs(0))
    tokens, pos, mask = _batch()
    with pytest.raises(ValueError, match="dense model"):
        dense.hidden_states(tokens, pos, mask, routing_ids=jnp.zeros((2, 8, 1, 2), jnp.int8))
    with pytest.raises(ValueError, match="dense model"):
        dense.forward_cached(tokens, pos, mask, init_cache(dense.cfg, 2, 8),
                             jnp.zeros(2, jnp.int32), return_routing=True)


def test_agreement_counts_equal_top_k_sets_against_numpy():
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(20, N_EXPERTS)).astype(np.float32))
    routing = route(logits, TOP_K, True)
    own = np.asarray(routing.expert_ids)
    rec = own[:, ::-1].copy()                             # same sets, other order
    rec[:6] = _forced_ids(rng, (6,))
    rec[6:9] = -1
    same = [set(a) == set(b) for a, b in zip(own, rec)]
    want = [sum(s for s, r in zip(same, rec) if r[0] >= 0), 17]
    np.testing.assert_array_equal(np.asarray(agreement_sums(routing, jnp.asarray(rec))), want)


def test_replay_on_a_sequence_mesh_equals_one_device():
    """Context parallelism folds the recorded ids like the tokens: the replayed forward on a
    ``sequence=2`` mesh (fake CPU devices) equals the one-device one."""
    from rlflow.config import MeshConfig
    from rlflow.mesh import make_mesh

    mesh = make_mesh(MeshConfig(sequence=2), jax.devices()[:2])
    model = Decoder(CFG, rngs=nnx.Rngs(5))
    tokens, pos, mask = _batch(3)
    ids = _forced_ids(np.random.default_rng(4), (2, 8, 3))
    ids[1, :2] = -1                                       # the left padding: no record
    graphdef, params = nnx.split(model)

    def run(p, m):
        return nnx.merge(graphdef, p).hidden_states(tokens, pos, mask, routing_ids=ids,
                                                    replay_routing=True, mesh=m)

    one = jax.jit(lambda p: run(p, None))(params)
    split = jax.jit(lambda p: run(p, mesh))(params)
    np.testing.assert_allclose(np.asarray(split.hidden), np.asarray(one.hidden), rtol=0,
                               atol=forward_atol(CFG, 8, float(np.abs(one.hidden).max())))
    np.testing.assert_array_equal(np.asarray(split.router_agreement)[:, 1],
                                  np.asarray(one.router_agreement)[:, 1])
    # the learner's own top-k on another program: equal unless a near tie flips (one at most)
    assert np.abs(np.asarray(split.router_agreement)
                  - np.asarray(one.router_agreement)).max() <= 1


def test_load_balancing_loss_and_replay_in_one_forward():
    """``moe_aux`` with ``routing_ids``: hidden, ``aux_loss`` and ``router_agreement``; replaying the model's
    own choice, the same hidden states, loss and agreement as the separate forwards."""
    model = Decoder(CFG, rngs=nnx.Rngs(6))
    tokens, pos, mask = _batch(5)
    own = model.forward_cached(tokens, pos, mask, init_cache(CFG, 2, 8),
                               jnp.zeros(2, jnp.int32), return_routing=True).expert_ids
    own = jnp.where(jnp.asarray(mask)[:, :, None, None], own, -1)
    out = model.hidden_states(tokens, pos, mask, moe_aux=True, routing_ids=own,
                              replay_routing=True)
    hidden, aux, agreement = out.hidden, out.aux_loss, out.router_agreement
    want = model.hidden_states(tokens, pos, mask, moe_aux=True)
    want_hidden, want_aux = want.hidden, want.aux_loss
    assert want.router_agreement is None                  # no recorded ids given
    want_agreement = model.hidden_states(tokens, pos, mask, routing_ids=own).router_agreement
    np.testing.assert_array_equal(np.asarray(hidden)[mask], np.asarray(want_hidden)[mask])
    np.testing.assert_allclose(float(aux), float(want_aux), rtol=sum_tol(8 * 3), atol=0)
    np.testing.assert_array_equal(np.asarray(agreement), np.asarray(want_agreement))
    assert np.asarray(agreement)[:, 1].tolist() == [mask.sum()] * 3
