"""Expert parallelism in the programs (issue 40 item 2): a tiny Qwen3-MoE model's train step
(loss, gradients, KL / entropy / IS statistics, per-token logprobs) on fsdp x expert and
expert x tensor meshes of fake CPU devices equals the single-device step, and the sampler
engine on expert and expert x tensor meshes gives the single-device greedy tokens and
logprobs (one single-device step and one single-device generation, module fixtures, are the
references of every mesh). A data x expert mesh is not run: the batch rule
(``mesh.batch_sharding``: rows over data x fsdp) and the expert rule are those of fsdp x
expert, which also gathers the fsdp-split weights.

Routing is discontinuous: a token whose k-th and (k+1)-th router logits were within the
float rounding of the two programs could take another expert on the mesh. The routers are
sharpened (x ``ROUTER_SCALE`` for the train step, x 6 with every weight for the sampler's
greedy paths) and each test first checks that every token's top-k logit gap
in every layer exceeds twice the two programs' bound on a logit (tests/tolerances.py), so the
comparison is of the same routing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlflow.config import MeshConfig, ModelConfig, RolloutCorrectionConfig, SamplerConfig
from rlflow.learner.batch import BatchSpec, TrainBatch, build_batch
from rlflow.learner.packing import PackSpec, pack_batch
from rlflow.learner.step import StepSettings, make_grad_fn, policy_logprobs
from rlflow.mesh import batch_sharding, make_mesh, param_shardings
from rlflow.models import build_model, expert_parallel, moe
from rlflow.models.attention import SequenceMask
from rlflow.models.decoder import rope_inv_freq
from rlflow.models.layer_scan import layer_modules
from rlflow.sampler.batching import ContinuousBatcher, Request
from rlflow.sampler.engine import RlflowEngine
from rlflow.sampler.sampling import SamplingParams
from learner_fixtures import assert_same_packed_step, make_group_records, model_and_reference
from tolerances import forward_atol

VOCAB, G, T = 64, 4, 6
MODEL = ModelConfig(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=32,
                    intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=16)
SPEC = BatchSpec(group_size=G, num_rows=8, seq_buckets=(16,), max_tokens=T)
MESHES = {"fsdp2_expert2": MeshConfig(fsdp=2, expert=2),
          "expert2_tensor2": MeshConfig(expert=2, tensor=2)}
ROUTER_SCALE = 30.0


def mesh_of(cfg: MeshConfig):
    return make_mesh(cfg, jax.devices()[:cfg.num_devices])


@pytest.fixture
def expert_meshes(monkeypatch):
    """The ``expert`` axis sizes the MoE layers were traced with (one per layer call)."""
    seen = []

    def spy(*args, mesh=None, **kw):
        seen.append(1 if mesh is None else dict(mesh.shape)["expert"])
        return expert_parallel.expert_ffn(*args, mesh=mesh, **kw)
    monkeypatch.setattr(moe, "expert_ffn", spy)
    return seen


def sharpen_routers(state):
    """``state`` with every router kernel times :data:`ROUTER_SCALE`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x * ROUTER_SCALE if "router" in jax.tree_util.keystr(path) else x,
        state)


def assert_routing_margins(model, tokens, positions, mask) -> None:
    """Every (layer, real token) gap between the k-th and (k+1)-th router logit of the
    one-device forward exceeds twice the bound on two float32 programs' logits
    (:func:`tolerances.forward_atol` at the scale of the router's log-probabilities): no
    top-k choice can differ between them."""
    inv_freq = rope_inv_freq(model.cfg)
    attend = SequenceMask(jnp.asarray(mask, bool), None, None, "xla", None)
    x = model._embed(jnp.asarray(tokens))
    k = model.cfg.num_experts_per_tok
    real = np.asarray(mask).reshape(-1)
    for layer, block in enumerate(layer_modules(model.layers)):
        x, routing = block(x, jnp.asarray(positions), inv_freq, attend, return_routing=True)
        probs = np.maximum(np.asarray(routing.probs), np.finfo(np.float32).tiny)
        logp = np.log(-np.sort(-probs, axis=-1))[real]
        gap = float((logp[:, k - 1] - logp[:, k]).min())
        # each of the two logits moves by at most forward_atol between the programs
        bound = forward_atol(model.cfg, tokens.shape[1], float(np.abs(logp).max()))
        assert gap > 2 * bound, (layer, gap, bound)


# --------------------------------------------------------------------------- train step

def settings():
    return StepSettings(loss_agg="seq-mean-token-mean", norm_len=T, micro_batches=2,
                        kl_coef=0.3, correction=RolloutCorrectionConfig(weight_cap=1.5),
                        max_loss_tokens=SPEC.num_rows * T, attention="xla")


@pytest.fixture(scope="module")
def moe_case():
    """A packed batch (8-row multiple: 2 micro-batches x 4 batch shards), the tiny MoE model
    and its KL reference, and the single-device step and logprobs."""
    graphdef, params, ref = model_and_reference(MODEL)
    params, ref = sharpen_routers(params), sharpen_routers(ref)
    recs = make_group_records(7, 2, vocab=VOCAB, group_size=G, max_tokens=T, noise=1.0)
    batch, _ = build_batch(recs, SPEC, 0)
    spec = PackSpec.create(num_rows=8, max_row=16, pack_length=16, buckets=2, split=8,
                           shared_prefix=False)
    packed, _ = pack_batch(batch, spec)
    assert packed.tokens.shape[0] % 8 == 0
    assert_routing_margins(nnx.merge(graphdef, params), packed.tokens, packed.positions,
                           packed.attention_mask)
    jb = TrainBatch(*packed)
    one = jax.jit(make_grad_fn(graphdef, settings()))(params, jb, ref)
    lp = np.asarray(jax.jit(functools.partial(policy_logprobs, graphdef,
                                              attention="xla"))(params, jb)[0])
    return graphdef, params, ref, packed, one, lp


@pytest.mark.parametrize("name", list(MESHES))
def test_moe_train_step_on_an_expert_mesh_equals_one_device(moe_case, name, expert_meshes):
    graphdef, params, ref, packed, (l0, g0, s0), lp0 = moe_case
    mesh = mesh_of(MESHES[name])
    psh = param_shardings(params, mesh)
    kernel = psh["layers"]["mlp"]["gate_kernel"].get_value()    # [L, n, E, F]
    assert kernel.spec[0] is None and kernel.spec[1] == "expert"   # the experts are split
    bsh = batch_sharding(mesh)
    jb = jax.device_put(TrainBatch(*packed), TrainBatch(*([bsh] * len(TrainBatch._fields))))
    p, r = jax.device_put(params, psh), jax.device_put(ref, psh)
    grad_fn = jax.jit(make_grad_fn(graphdef, settings(), mesh))
    l1, g1, s1 = grad_fn(p, jb, r)
    lp1 = jax.jit(functools.partial(policy_logprobs, graphdef, attention="xla",
                                    mesh=mesh))(p, jb)[0]
    assert_same_packed_step(MODEL, packed, (l0, g0, s0, lp0), (l1, g1, s1, lp1))
    assert expert_meshes and set(expert_meshes) == {2}      # every MoE layer split its experts
    gk = g1["layers"]["mlp"]["gate_kernel"].get_value()
    assert gk.sharding.spec[1] == "expert" and float(jnp.abs(gk).max()) > 0


# --------------------------------------------------------------------------- sampler

def sampler_cfg():
    return SamplerConfig(num_slots=4, max_prefill_length=16, prefill_buckets=(8, 16),
                         max_tokens=6, temperature=0.0)


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]


def _generate(model, mesh):
    reqs = [Request(i, p, 1, SamplingParams(temperature=0.0, max_tokens=6))
            for i, p in enumerate(PROMPTS)]
    engine = RlflowEngine(model, sampler_cfg(), mesh=mesh)
    return {g.prompt_id: g for g in ContinuousBatcher(engine).run(reqs)}


@pytest.fixture(scope="module")
def sampler_case():
    """The sampler's tiny MoE model (weights x 6: sharp routers) and its single-device greedy
    generations of :data:`PROMPTS` (``{prompt_id: group}``), traced with an unsplit MoE."""
    model = build_model(ModelConfig(**{**MODEL.__dict__, "vocab_size": 128,
                                       "init_seed": 3}))[0]
    nnx.update(model, jax.tree_util.tree_map(lambda x: x * 6.0, nnx.state(model, nnx.Param)))
    seen = []

    def spy(*args, mesh=None, **kw):
        seen.append(1 if mesh is None else dict(mesh.shape)["expert"])
        return expert_parallel.expert_ffn(*args, mesh=mesh, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "expert_ffn", spy)
        base = _generate(model, mesh_of(MeshConfig()))
    assert seen and set(seen) == {1}                # prefill and decode, experts unsplit
    # the greedy paths route with margins far above the rounding (module doc)
    for i, p in enumerate(PROMPTS):
        seq = p + base[i].completions[0].tokens.tolist()
        assert_routing_margins(model, np.asarray([seq]), np.arange(len(seq))[None],
                               np.ones((1, len(seq)), bool))
    assert len({tuple(base[i].completions[0].tokens) for i in range(3)}) > 1
    return model, base


@pytest.mark.parametrize("mesh_name,mesh_cfg", [("expert4", MeshConfig(expert=4)),
                                                ("expert2_tensor2",
                                                 MeshConfig(expert=2, tensor=2))])
def test_sampler_on_an_expert_mesh_gives_the_single_device_tokens(sampler_case, mesh_name,
                                                                  mesh_cfg, expert_meshes):
    model, base = sampler_case
    got = _generate(model, mesh_of(mesh_cfg))
    assert set(expert_meshes) == {mesh_cfg.expert}       # prefill and decode split the experts
    assert sorted(got) == sorted(base)
    for pid, g in got.items():
        c, want = g.completions[0], base[pid].completions[0]
        assert c.tokens.tolist() == want.tokens.tolist(), (mesh_name, pid)
        np.testing.assert_allclose(c.logprobs, want.logprobs, rtol=0, atol=forward_atol(
            model.cfg, 16, float(np.abs(want.logprobs).max())))
