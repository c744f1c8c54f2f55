"""The projections of the decoder: one matmul for every kernel (:func:`_dense`, with its
CPU-backend dtype handling) and the normal initialisation of every parameter
(:func:`_normal`, logical axes as ``out_sharding`` metadata; ``rlflow.mesh`` places them).
Shared by the dense layers (:mod:`rlflow.models.decoder`) and the experts
(:mod:`rlflow.models.moe`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

INIT_STD = 0.02      # normal init of kernels / embedding of a random model (HF default)


def _dense(x: jax.Array, kernel: jax.Array, preferred_element_type=None,
           out_in: bool = False) -> jax.Array:
    """``x [..., I] @ kernel [I, O...] -> [..., O...]`` as one 2-D matmul ``[N, I] @ [I, O]``;
    with ``out_in`` the kernel is 2-D and stored transposed, ``[O, I]``, and the dot
    contracts its second axis (the sampler engine's CPU layout,
    :mod:`rlflow.sampler.kernel_layout`).

    One contracting dimension in the backward too: the weight gradient of an einsum over
    ``[B, T, I]`` contracts two dimensions (b, t), and XLA:CPU then copies the output
    gradient into a transposed layout (a strided ``[O, B * T]`` write per projection, 1.6x
    the whole MLP step at 16 x 192 x 896); flattened, it multiplies in place.

    Products of bfloat16 operands accumulate in float32 and the result is rounded once to
    the operands' dtype (``preferred_element_type=None``). On the CPU backend the dot is
    asked for the float32 result and rounded after it: asked for a bfloat16 result, XLA:CPU
    upcasts both operands to float32 before the dot, and inside a decode loop hoists that
    upcast of the weights out of the loop, so every step streams float32 weights, twice the
    bytes of its native bf16 x bf16 -> f32 dot (benchmarks/sampler_throughput.py). TPU and
    GPU dots accumulate bfloat16 products in float32 anyway, and there a float32 result
    would make the backward's dots mixed-precision (float32 cotangents), so they keep it.
    """
    lead, out = x.shape[:-1], (kernel.shape[:1] if out_in else kernel.shape[1:])
    widen = (preferred_element_type is None and x.dtype == kernel.dtype
             and jnp.dtype(x.dtype).itemsize < 4 and jax.default_backend() == "cpu")
    rows = x.reshape(-1, x.shape[-1])
    want = jnp.float32 if widen else preferred_element_type
    if out_in:      # explicit: XLA:CPU copied a transposed kernel back rather than fold it
        y = jax.lax.dot_general(rows, kernel, (((1,), (1,)), ((), ())),
                                preferred_element_type=want)
    else:
        y = jnp.matmul(rows, kernel.reshape(kernel.shape[0], -1), preferred_element_type=want)
    if widen:
        y = y.astype(x.dtype)
    return y.reshape(lead + out)

def _cpu_dot_operands(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Operands of a batched dot with a float32 result: on the CPU backend, bfloat16 ones
    are upcast to float32 (XLA:CPU's batched dot has no BF16 x BF16 = F32 kernel: "Unsupported
    element type for DotThunk::Execute"); elsewhere (TPU, GPU) they stay as they are."""
    if jax.default_backend() == "cpu" and jnp.dtype(a.dtype).itemsize < 4:
        return a.astype(jnp.float32), b.astype(jnp.float32)
    return a, b


def _param(value, axes: tuple) -> nnx.Param:
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _normal(rngs: nnx.Rngs, shape, dtype, axes) -> nnx.Param:
    return _param((INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype),
                  axes)
