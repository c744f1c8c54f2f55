"""Qwen3.5-MoE (a gated DeltaNet hybrid with experts) on fake CPU devices: the train step's
loss and gradients on an fsdp=2 x tensor=2 mesh (the DeltaNet's projections, convs and gates
split along its key / value heads, logical ``kv_heads`` / ``q_heads``; attention heads and
the shared expert over ``tensor``) and on an fsdp=2 x expert=2 mesh (every layer's experts
split over ``expert``) equal one device's (issue 51). One single-device step (a module
fixture, one compile) is the reference of both meshes. The MoE model holds every part of the
dense Qwen3.5 but its MLP (the plain MLP's sharding is every other family's), so dense
Qwen3.5 is not run again (each mesh costs a compile of ~17 CPU s).

Tolerance. The tiny random hybrids are ill-conditioned: a relative perturbation of one
float32 ulp (``F32_EPS``) of every parameter moves their gradients by ~5e-5 relative, about
400 ulps, where the attention-only families move by a few ulps (a gated RMSNorm of small
DeltaNet outputs, l2-normalised q / k). So the bound is measured, not assumed: ``kappa``, the
relative change of each gradient leaf (and of the loss) when every parameter is perturbed by
one random ulp, on the same compiled single-device step. Each program's rounding acts as
perturbations of that size along the forward / backward chain of ``model_chain_len``
reductions; independent roundings add as a random walk, so two programs differ by at most
``2 sqrt(chain) kappa`` (about 5e-3 here, measured differences ~1e-4). A sharding error (a
missing reduction over a split axis, heads split at the wrong place) moves a gradient by
O(1) relative.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlflow.config import MeshConfig, ModelConfig, RolloutCorrectionConfig
from rlflow.learner.batch import BatchSpec, TrainBatch, build_batch
from rlflow.learner.packing import PackSpec, pack_batch
from rlflow.learner.step import StepSettings, make_grad_fn
from rlflow.mesh import batch_sharding, make_mesh, param_shardings
from rlflow.models import expert_parallel, moe
from hf_fixtures import make_tiny_qwen35
from learner_fixtures import flat, make_group_records, model_and_reference
from tolerances import F32_EPS, model_chain_len

G, T = 4, 6
#: (name, mesh, a stacked parameter the mesh must split, the mesh axis of that split, the
#: expert axis every MoE layer must run with)
CASES = [
    ("fsdp2_tensor2", MeshConfig(fsdp=2, tensor=2), "linear_attention.attn.v_kernel", "tensor", 1),
    ("fsdp2_expert2", MeshConfig(fsdp=2, expert=2), "linear_attention.mlp.up_kernel", "expert", 2),
]


def settings():
    return StepSettings(loss_agg="seq-mean-token-mean", norm_len=T, micro_batches=1,
                        kl_coef=0.3, correction=RolloutCorrectionConfig(weight_cap=1.5),
                        max_loss_tokens=8 * T, attention="xla")


def _packed_batch():
    recs = make_group_records(7, 2, vocab=64, group_size=G, max_tokens=T, noise=1.0)
    batch, _ = build_batch(recs, BatchSpec(group_size=G, num_rows=8, seq_buckets=(16,),
                                           max_tokens=T), 0)
    spec = PackSpec.create(num_rows=8, max_row=16, pack_length=16, buckets=2, split=8,
                           shared_prefix=False)     # a DeltaNet state is one sequence's
    packed, _ = pack_batch(batch, spec)
    assert packed.tokens.shape[0] % 4 == 0           # rows split over fsdp x expert
    return packed


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    """A tiny Qwen3.5-MoE (4 layers: three DeltaNet, one gated attention) and its KL reference, a packed batch, the single-device ``(loss,
    grads)`` and ``kappa``: per gradient leaf (and ``"loss"``) the relative change when
    every parameter is moved by one random float32 ulp (module doc)."""
    path = make_tiny_qwen35(str(tmp_path_factory.mktemp("qwen35_moe")), num_layers=4, moe=True)
    model_cfg = ModelConfig(path=path)
    graphdef, params, ref = model_and_reference(model_cfg)
    packed = _packed_batch()
    step = jax.jit(make_grad_fn(graphdef, settings()))
    loss, grads, _ = step(params, TrainBatch(*packed), ref)
    rng = np.random.default_rng(0)                  # numpy: no eager compile per shape
    moved = jax.tree.map(lambda p: jnp.asarray(np.asarray(p) * (
        1 + F32_EPS * rng.standard_normal(p.shape)).astype(np.float32)), params)
    loss2, grads2, _ = step(moved, TrainBatch(*packed), ref)
    g, g2 = flat(grads), flat(grads2)
    kappa = {k: _rel(g2[k], g[k]) for k in g}
    kappa["loss"] = abs(float(loss2) - float(loss)) / abs(float(loss))
    chain = model_chain_len(nnx.merge(graphdef, params).cfg, packed.tokens.shape[1])
    return graphdef, params, ref, packed, (float(loss), g), kappa, chain


@pytest.mark.slow
@pytest.mark.parametrize("name,mesh_cfg,stacked,axis,experts", CASES, ids=[c[0] for c in CASES])
def test_sharded_train_step_equals_one_device(single_device, monkeypatch, name, mesh_cfg,
                                              stacked, axis, experts):
    graphdef, params, ref, packed, (loss0, g0), kappa, chain = single_device
    mesh = make_mesh(mesh_cfg, jax.devices()[:mesh_cfg.num_devices])
    psh = param_shardings(params, mesh)
    split = psh["layers"]
    for key in stacked.split("."):
        split = split[key]
    assert axis in jax.tree.leaves(tuple(split.get_value().spec)), split.get_value().spec
    seen = []                                       # expert axis of each traced MoE layer

    def spy(*args, mesh=None, **kw):
        seen.append(1 if mesh is None else dict(mesh.shape)["expert"])
        return expert_parallel.expert_ffn(*args, mesh=mesh, **kw)
    monkeypatch.setattr(moe, "expert_ffn", spy)
    bsh = batch_sharding(mesh)
    jb = jax.device_put(TrainBatch(*packed), TrainBatch(*([bsh] * len(TrainBatch._fields))))
    loss1, g1, _ = jax.jit(make_grad_fn(graphdef, settings(), mesh))(
        jax.device_put(params, psh), jb, jax.device_put(ref, psh))
    walk = 2 * math.sqrt(chain)                     # two programs, a random walk of roundings
    assert abs(float(loss1) - loss0) <= walk * kappa["loss"] * abs(loss0), (loss1, loss0)
    g1 = flat(g1)
    for key, want in g0.items():
        assert float(jnp.abs(want).max()) > 0, key
        assert _rel(g1[key], want) <= walk * kappa[key], (key, _rel(g1[key], want), kappa[key])
    assert seen and set(seen) == {experts}          # every MoE layer, its experts' split
