"""The GatedDeltaNet layer (rlflow.models.gdn_layer) against transformers 5.25's own
``Qwen3_5GatedDeltaNet`` and ``Qwen3NextGatedDeltaNet`` in float32 on tiny random configs:
padded rows, packed rows, decode steps after a prefill; and the decode-state bytes.

Tolerance (tests/tolerances.py): an output passes through the reductions of the input
projection (``E`` terms), the conv (``K``), the L2 norm (``d_k``), the gated delta rule
(``T (d_k + 2 C + 4)``, see test_gated_delta.py), the gated RMSNorm (``d_v``) and the output
projection (``Hv d_v``); each program is within ``chain * eps * max|y|`` of the exact value
(the decoder's ``forward_atol`` convention), two programs within twice that.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from rlflow.models import gdn_layer  # noqa: E402
from tolerances import F32_EPS  # noqa: E402

SHAPES = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
              num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6,
              vocab_size=64)
CHUNK = 8



# The layer runs jitted, as the learner and the sampler run it: one compile per shape.
# Called eagerly, JAX dispatches (and compiles) every operation on its own: about 1,300
# compiles for this file.
@nnx.jit
def forward(layer, x, **kwargs):
    """``layer(x, **kwargs)`` (``attention_mask``, ``segment_ids``, ``state``)."""
    return layer(x, **kwargs)


@nnx.jit
def decode_step(layer, x, state):
    """``layer.step(x, state)``."""
    return layer.step(x, state)

def hf_layer(family: str, seed: int = 0):
    """A transformers GatedDeltaNet with random weights: projections 0.3 N(0, 1), norm
    scale 1 + 0.2 N(0, 1), ``A = exp(A_log)`` in (0.1, 2), ``dt_bias`` N(0, 1)."""
    if family == "qwen3_5":
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
        cfg, cls = transformers.Qwen3_5TextConfig(**SHAPES), m.Qwen3_5GatedDeltaNet
    else:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
        cfg, cls = transformers.Qwen3NextConfig(**SHAPES), m.Qwen3NextGatedDeltaNet
    torch.manual_seed(seed)
    layer = cls(cfg, 0).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.1, 2.0, generator=gen)))
            elif name == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return cfg, layer


def ours(cfg, hf, **spec_overrides):
    spec = gdn_layer.GDNSpec.from_hf(cfg, chunk_size=CHUNK, **spec_overrides)
    layer = gdn_layer.GatedDeltaNet(spec, rngs=nnx.Rngs(0))
    gdn_layer.hf_to_params(layer, {n: t.detach().numpy() for n, t in hf.state_dict().items()})
    return layer


def run_hf(hf, x, mask=None):
    with torch.no_grad():
        return hf(torch.from_numpy(x),
                  attention_mask=None if mask is None else torch.from_numpy(mask)).numpy()


def atol(t: int, ref) -> float:
    s = SHAPES
    chain = (s["hidden_size"] + s["linear_conv_kernel_dim"] + s["linear_key_head_dim"]
             + t * (s["linear_key_head_dim"] + 2 * CHUNK + 4) + s["linear_value_head_dim"]
             + s["linear_num_value_heads"] * s["linear_value_head_dim"])
    return 2 * chain * F32_EPS * float(np.abs(ref).max())


def activations(b, t, seed=0):
    return np.random.default_rng(seed).normal(size=(b, t, SHAPES["hidden_size"])).astype(
        np.float32)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("impl,precision", [("auto", None), ("recurrent", "highest")])
def test_layer_matches_transformers_on_padded_rows(family, impl, precision):
    cfg, hf = hf_layer(family)
    layer = ours(cfg, hf, impl=impl, precision=precision)
    x = activations(2, 21)
    mask = np.ones((2, 21), bool)
    mask[1, :5] = False      # left padding
    ref = run_hf(hf, x, mask)
    y, state = forward(layer, x, attention_mask=mask)
    assert y.shape == (2, 21, 32) and y.dtype == jnp.float32
    assert state.conv_q.shape == state.conv_k.shape == (2, 3, 2, 8)
    assert state.conv_v.shape == (2, 3, 4, 6) and state.recurrent.shape == (2, 4, 8, 6)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=atol(21, ref))
    # the padded row's real tokens equal the same tokens run unpadded
    alone = run_hf(hf, x[1:, 5:])
    np.testing.assert_allclose(np.asarray(y[1, 5:]), alone[0], rtol=0, atol=atol(21, ref))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_export_returns_the_imported_qwen3_5_tensors(family):
    cfg, hf = hf_layer(family, seed=7)
    layer = ours(cfg, hf)
    tensors = {n: t.detach().numpy() for n, t in hf.state_dict().items()}
    if family == "qwen3_next":
        tensors = gdn_layer.qwen3_next_to_qwen3_5(tensors, layer.spec)
    out = gdn_layer.params_to_hf(layer)
    assert out.keys() == tensors.keys()
    for name, t in tensors.items():
        np.testing.assert_array_equal(out[name], t, err_msg=name)


def test_packed_row_equals_its_segments_in_transformers():
    cfg, hf = hf_layer("qwen3_5", seed=1)
    layer = ours(cfg, hf)
    x = activations(1, 23, seed=1)
    seg = np.array([[0] * 6 + [1] * 2 + [2] * 15])
    y, _ = forward(layer, x, segment_ids=seg)
    for lo, hi in ((0, 6), (6, 8), (8, 23)):
        ref = run_hf(hf, x[:, lo:hi])
        np.testing.assert_allclose(np.asarray(y[:, lo:hi]), ref, rtol=0, atol=atol(23, ref),
                                   err_msg=f"segment [{lo}, {hi})")


@pytest.mark.parametrize("prefill", [1, 3, 13])
def test_decode_steps_after_prefill_equal_the_full_sequence(prefill):
    cfg, hf = hf_layer("qwen3_5", seed=2)
    layer = ours(cfg, hf)
    x = activations(2, 20, seed=2)
    ref = run_hf(hf, x)
    out, state = forward(layer, x[:, :prefill])
    outs = [np.asarray(out)]
    for i in range(prefill, 20):
        y, state = decode_step(layer, x[:, i], state)
        assert y.shape == (2, 32)
        outs.append(np.asarray(y)[:, None])
    np.testing.assert_allclose(np.concatenate(outs, 1), ref, rtol=0, atol=atol(20, ref))
    # a fresh slot: zero state, step by step from the first token
    state = gdn_layer.init_state(layer.spec, 2)
    for i in range(3):
        y, state = decode_step(layer, x[:, i], state)
    np.testing.assert_allclose(np.asarray(y), ref[:, 2], rtol=0, atol=atol(20, ref))


def test_continued_sequence_from_a_state_equals_one_pass():
    cfg, hf = hf_layer("qwen3_5", seed=3)
    layer = ours(cfg, hf)
    x = activations(2, 19, seed=3)
    ref = run_hf(hf, x)
    a, state = forward(layer, x[:, :2])          # shorter than the conv window
    b, state = forward(layer, x[:, 2:11], state=state)
    c, _ = forward(layer, x[:, 11:], state=state)
    np.testing.assert_allclose(np.concatenate([a, b, c], 1), ref, rtol=0, atol=atol(19, ref))


def test_bfloat16_layer_runs_and_params_shard_by_rules():
    import jax

    from rlflow.config import MeshConfig
    from rlflow.mesh import logical_sharding, make_mesh, param_shardings

    cfg, hf = hf_layer("qwen3_5")
    layer = ours(cfg, hf, dtype="bfloat16", param_dtype="bfloat16")
    y, state = forward(layer, activations(1, 5).astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and state.conv_v.dtype == jnp.bfloat16
    assert state.recurrent.dtype == jnp.float32
    assert np.isfinite(np.asarray(y, np.float32)).all()
    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    shardings = param_shardings(nnx.state(layer, nnx.Param), mesh)
    assert len(jax.tree.leaves(shardings)) == 13
    for arr, axes in zip(state, gdn_layer.STATE_AXES):
        logical_sharding(mesh, axes, arr.shape)


def test_state_bytes_are_constant_in_sequence_length_and_match_the_arrays():
    # Qwen3.5-shaped linear layer (transformers' Qwen3_5TextConfig defaults)
    cfg = transformers.Qwen3_5TextConfig()
    spec = gdn_layer.GDNSpec.from_hf(cfg, dtype="bfloat16")
    state = gdn_layer.init_state(spec, 1)
    assert gdn_layer.decode_state_bytes(spec) == sum(a.nbytes for a in state)
    # conv (4 - 1) * (2 * 16 * 128 + 32 * 128) bf16 + 32 * 128 * 128 float32
    assert gdn_layer.decode_state_bytes(spec) == 3 * 8192 * 2 + 32 * 128 * 128 * 4
    kv = [gdn_layer.kv_cache_bytes(num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                   tokens=t) for t in (2048, 8192, 32768)]
    assert kv == [2 * cfg.num_key_value_heads * cfg.head_dim * t * 2 for t in (2048, 8192, 32768)]


def test_spec_errors():
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        gdn_layer.GDNSpec(32, num_k_heads=3, num_v_heads=4, head_k_dim=8, head_v_dim=8)
    with pytest.raises(ValueError, match="expected one of"):
        gdn_layer.GDNSpec(32, 2, 4, 8, 8, impl="fla")
    with pytest.raises(ValueError, match="precision must be"):
        gdn_layer.GDNSpec(32, 2, 4, 8, 8, precision="fp32")
    cfg = transformers.Qwen3_5TextConfig(**SHAPES)
    cfg.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        gdn_layer.GDNSpec.from_hf(cfg)
    cfg, hf = hf_layer("qwen3_5")
    layer = ours(cfg, hf)
    tensors = {n: t.detach().numpy() for n, t in hf.state_dict().items()}
    with pytest.raises(KeyError, match="in_proj_z.weight"):
        gdn_layer.hf_to_params(layer, {n: t for n, t in tensors.items() if n != "in_proj_z.weight"})
    tensors["conv1d.weight"] = tensors["conv1d.weight"][:, :, :3]
    with pytest.raises(ValueError, match="conv1d.weight"):
        gdn_layer.hf_to_params(layer, tensors)


def test_parameter_gradients_of_chunked_and_recurrent_layers_agree():
    """The learner differentiates the chunked layer; its parameter gradients equal the
    recurrent layer's (both float32; the chain of the forward, scaled by the largest
    gradient, twice: forward and the transposed backward)."""
    cfg, hf = hf_layer("qwen3_5", seed=4)
    x = activations(2, 13, seed=4)
    seg = np.array([[0] * 4 + [1] * 9, [2] * 13])
    w = np.random.default_rng(5).normal(size=(2, 13, 32)).astype(np.float32)
    grads = []
    for impl in ("auto", "recurrent"):
        layer = ours(cfg, hf, impl=impl)
        loss = lambda m: jnp.sum(m(x, segment_ids=seg)[0] * w)
        grads.append(nnx.state(nnx.jit(nnx.grad(loss))(layer), nnx.Param))
    flat = [dict((jax_path(p), np.asarray(v)) for p, v in nnx.to_flat_state(g)) for g in grads]
    assert flat[0].keys() == flat[1].keys() and len(flat[0]) == 13
    for name in flat[0]:
        a, b = flat[0][name], flat[1][name]
        assert np.isfinite(a).all() and np.abs(b).max() > 0, name
        np.testing.assert_allclose(a, b, rtol=0, atol=2 * atol(13, b), err_msg=name)


def jax_path(path) -> str:
    return "/".join(str(p) for p in path)


def test_sharded_layer_equals_one_device():
    """fsdp=2 x tensor=2 on fake CPU devices: heads (2 key, 4 value) over tensor, embed and
    the batch over fsdp; a prefill and a decode step equal the unsharded layer's."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rlflow.config import MeshConfig
    from rlflow.mesh import logical_sharding, make_mesh, shard_params

    cfg, hf = hf_layer("qwen3_5", seed=6)
    layer = ours(cfg, hf)
    x = activations(2, 11, seed=6)
    want, want_state = forward(layer, x[:, :10])
    want_step, _ = decode_step(layer, x[:, 10], want_state)
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2))
    graph, params = nnx.split(layer, nnx.Param)
    params = shard_params(params, mesh)
    assert params["q_kernel"][...].sharding.spec == P("fsdp", "tensor", None)

    @jax.jit
    def run(params, x, nxt):
        m = nnx.merge(graph, params)
        y, state = m(x)
        state = jax.lax.with_sharding_constraint(state, gdn_layer.GDNState(*(
            logical_sharding(mesh, axes, a.shape) for axes, a in
            zip(gdn_layer.STATE_AXES, state))))
        return y, m.step(nxt, state)[0]

    rows = NamedSharding(mesh, P("fsdp"))
    y, y_step = run(params, jax.device_put(x[:, :10], rows), jax.device_put(x[:, 10], rows))
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=0, atol=atol(10, want))
    np.testing.assert_allclose(np.asarray(y_step), np.asarray(want_step), rtol=0,
                               atol=atol(11, want_step))
