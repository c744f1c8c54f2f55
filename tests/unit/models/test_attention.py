"""Learner attention (rlflow/models/attention.py): the materialised reference against a float64
numpy oracle; blockwise and the Pallas kernels (splash, gpu_flash; interpret mode on CPU)
against the reference on causal + padding + packed segments + shared-prompt prefix masks,
values and gradients; the choice per backend; and a compiled-memory bound showing that the
blockwise forward + backward holds no ``[T, T]`` buffer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlflow.config import ConfigError, LearnerConfig
from rlflow.models import attention as A
from tolerances import F32_EPS, MIXED_SIGN_CANCEL

B, T, H, K, D = 2, 40, 4, 2, 8


def numpy_attention(q, k, v, attention_mask, segment_ids=None, prefix_ids=None):
    """float64 oracle: causal GQA softmax attention, masked logits at MASK_VALUE."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    t, h = q.shape[1], q.shape[2]
    k, v = np.repeat(k, h // k.shape[2], axis=2), np.repeat(v, h // v.shape[2], axis=2)
    ok = np.tril(np.ones((t, t), bool))[None] & np.asarray(attention_mask, bool)[:, None, :]
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        same = seg[:, :, None] == seg[:, None, :]
        if prefix_ids is not None:
            same |= np.asarray(prefix_ids)[:, :, None] == seg[:, None, :]
        ok &= same
    s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(ok[:, None], s, A.MASK_VALUE)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


def _masks():
    """Row 0 left-padded (5 pads), row 1 packed: a shared prompt (segment 9), two samples
    continuing it (1, 2), right padding (segment 0, masked)."""
    mask = np.ones((B, T), bool)
    mask[0, :5] = False
    mask[1, 33:] = False
    seg = np.zeros((B, T), np.int32)
    seg[0, 5:] = 3
    seg[1, :10], seg[1, 10:20], seg[1, 20:33] = 9, 1, 2
    prefix = seg.copy()
    prefix[1, 10:33] = 9
    return {"padding": (mask, None, None), "segments": (mask, seg, None),
            "prefix": (mask, seg, prefix)}


MASKS = _masks()


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.normal(size=s), jnp.float32)
                 for s in ((B, T, H, D), (B, T, K, D), (B, T, K, D)))


def _tol(scale):
    """A softmax-weighted sum of values: reductions over D (scores) and T (normaliser and
    weighted sum): chain D + 2T, two programs -> 2 chain eps relative to max |v|."""
    return 2 * (D + 2 * T) * F32_EPS * scale


@pytest.mark.parametrize("case", sorted(MASKS))
def test_reference_equals_numpy_oracle(qkv, case):
    """"xla" (materialised scores) equals the float64 oracle on every row, including the
    fully masked padding rows (uniform average of all values: finite)."""
    q, k, v = qkv
    mask, seg, prefix = MASKS[case]
    got = np.asarray(A.attention(q, k, v, attention_mask=mask, segment_ids=seg,
                                 prefix_ids=prefix, impl="xla"))
    np.testing.assert_allclose(got, numpy_attention(q, k, v, mask, seg, prefix), rtol=0,
                               atol=_tol(float(jnp.abs(v).max())))
    np.testing.assert_allclose(got[0, 0], np.asarray(v[0]).mean(0).repeat(H // K, 0),
                               atol=_tol(float(jnp.abs(v).max())))


def _loss(impl, mask, seg, prefix, w, block=16):
    """sum(w * out) over real query rows: a mixed-sign scalar whose gradient reaches q, k, v."""
    def f(q, k, v):
        out = A.attention(q, k, v, attention_mask=mask, segment_ids=seg, prefix_ids=prefix,
                          impl=impl, block_size=block)
        return jnp.sum(jnp.where(jnp.asarray(mask)[:, :, None, None], out * w, 0.0))
    return f


IMPL_CASES = [("blockwise", c) for c in sorted(MASKS)] + [
    (impl, c) for impl in ("splash", "gpu_flash") for c in ("padding", "segments")]


@pytest.mark.parametrize("impl,case", IMPL_CASES)
def test_implementation_equals_reference_values_and_gradients(qkv, impl, case):
    """Each implementation (blockwise with 16-token blocks, 40 tokens: a partial last block;
    the kernels in Pallas interpret mode) gives the reference's outputs at real query rows
    and the gradients of a mixed-sign loss of them w.r.t. q, k, v; every row finite."""
    q, k, v = qkv
    mask, seg, prefix = MASKS[case]
    ref = np.asarray(A.attention(q, k, v, attention_mask=mask, segment_ids=seg,
                                 prefix_ids=prefix, impl="xla"))
    got = np.asarray(A.attention(q, k, v, attention_mask=mask, segment_ids=seg,
                                 prefix_ids=prefix, impl=impl, block_size=16))
    assert np.isfinite(got).all()
    rows = mask if impl != "blockwise" else np.ones_like(mask)   # blockwise: padding rows too
    np.testing.assert_allclose(got[rows], ref[rows], rtol=0,
                               atol=_tol(float(jnp.abs(v).max())))
    w = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, H, D)), jnp.float32)
    g_ref = jax.grad(_loss("xla", mask, seg, prefix, w), argnums=(0, 1, 2))(q, k, v)
    g_got = jax.grad(_loss(impl, mask, seg, prefix, w), argnums=(0, 1, 2))(q, k, v)
    # backward: the forward chain, the softmax Jacobian's reduction over T and the GQA sum
    # over H / K query heads; mixed-sign terms (w is zero-mean)
    rtol = 2 * (D + 3 * T + H // K) * F32_EPS * MIXED_SIGN_CANCEL
    for name, a, b in zip("qkv", g_got, g_ref):
        err = np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
        assert err <= rtol, (name, err, rtol)


def test_bfloat16_blockwise_equals_reference(qkv):
    """bfloat16 operands (the TPU compute dtype): blockwise within bf16 rounding of xla."""
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv)
    mask, seg, prefix = MASKS["prefix"]
    out = [np.asarray(A.attention(q, k, v, attention_mask=mask, segment_ids=seg,
                                  prefix_ids=prefix, impl=i, block_size=16), np.float32)
           for i in ("xla", "blockwise")]
    # probabilities and output rounded to bf16 once each in either program
    np.testing.assert_allclose(out[1][mask], out[0][mask], rtol=0,
                               atol=4 * 2.0 ** -7 * float(jnp.abs(v.astype(jnp.float32)).max()))


def test_auto_per_backend_and_named_errors(qkv):
    assert A.resolve("auto", prefix=False, backend="tpu") == "splash"
    assert A.resolve("auto", prefix=False, backend="gpu") == "gpu_flash"
    assert A.resolve("auto", prefix=False, backend="cpu") == "blockwise"
    for backend in ("tpu", "gpu", "cpu"):        # the prefix mask: blockwise everywhere
        assert A.resolve("auto", prefix=True, backend=backend) == "blockwise"
    assert A.resolve("xla", prefix=True) == "xla"
    with pytest.raises(ValueError, match="learner.attention.*'flash'"):
        A.resolve("flash", prefix=False)
    q, k, v = qkv
    mask, seg, prefix = MASKS["prefix"]
    with pytest.raises(ValueError, match="'splash' cannot express the shared-prompt prefix"):
        A.attention(q, k, v, attention_mask=mask, segment_ids=seg, prefix_ids=prefix,
                    impl="splash")
    with pytest.raises(ValueError, match="prefix_ids needs segment_ids"):
        A.attention(q, k, v, attention_mask=mask, prefix_ids=prefix)
    with pytest.raises(ValueError, match=r"H % K == 0"):
        A.attention(q[:, :, :3], k, v, attention_mask=mask)
    with pytest.raises(ConfigError, match="learner.attention"):
        LearnerConfig(attention="flash")
    with pytest.raises(ConfigError, match="learner.attention: 'gpu_flash' cannot express"):
        LearnerConfig(attention="gpu_flash")                 # packing + shared prefix on
    assert LearnerConfig(attention="gpu_flash", shared_prefix=False).attention == "gpu_flash"
    with pytest.raises(ConfigError, match="learner.logprob_chunk"):
        LearnerConfig(logprob_chunk=-1)


def test_blockwise_forward_backward_holds_no_T_by_T_buffer():
    """Compiled (XLA memory analysis; nothing runs) forward + backward at T = 4096, 2 heads,
    blocks of 256: temporaries far below one float32 ``[H, T, T]`` score tensor (what "xla"
    holds, 128 MiB), and within the linear bound the blocking gives."""
    t, h, d, blk = 4096, 2, 16, 256
    shape = jax.ShapeDtypeStruct((1, t, h, d), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, t), jnp.bool_)

    def temp_bytes(impl):
        def f(q, k, v, m):
            return jnp.sum(A.attention(q, k, v, attention_mask=m, impl=impl, block_size=blk))
        c = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(shape, shape, shape, mask).compile()
        return c.memory_analysis().temp_size_in_bytes

    scores = h * t * t * 4
    blockwise = temp_bytes("blockwise")
    assert temp_bytes("xla") >= scores                  # the reference does hold [H, T, T]
    assert blockwise < scores / 8
    # linear bound: q/k/v/out and their gradients (8 x T x H x D floats), per query block
    # its key-block residuals (T / blk of [H, blk, D] accumulators) and a handful of
    # [H, blk, blk] score tiles, x 4 bytes, with 2x slack for XLA's buffer assignment
    linear = 4 * (8 * t * h * d + (t // blk) * h * blk * (d + 2) + 8 * h * blk * blk)
    assert blockwise <= 2 * linear, (blockwise, linear)
