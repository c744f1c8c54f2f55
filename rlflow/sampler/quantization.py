"""Int8 sampler weights (``sampler.quantization="int8"``), quantized with qwix.

What is quantized: every *projection kernel* of the parameter tree, found by name and
logical axes, never by layer path, so a stacked ``[L, ...]`` layout is covered alike: a leaf
named ``*_kernel`` (attention q/k/v/o, MLP gate/up/down) or ``lm_head`` with at least two
axes, outside LoRA adapters (``*_lora`` modules keep their float32 factors). Embeddings stay
in the sampler dtype (a gather table; with tied embeddings also the LM head, so that table
is not quantized either), and so do norms and biases; the KV cache keeps the sampler dtype.

How: ``qwix.quantize(w, jnp.int8, channelwise_axes=...)``: symmetric absmax, one scale per
output channel, ``scale = max_k |w[k, c]| / 127.5`` over the projection's input axes
``k`` (qwix maps the channel onto ``[-127.5, 127.5]`` so the end buckets are whole) and
``q = round(w / scale)`` in int8, saturating (qwix's ``calibrate`` /
``compute_scale_zero_point`` / ``quantize_with_scale_zero_point``; the scale in the sampler
dtype). The rounding error of each weight is at most ``scale / 2``. A kernel's input (contracting) axes come from its
logical axes (``nnx.Param`` ``out_sharding``, :mod:`rlflow.mesh`): leading axes that are
not projection axes (a stacking ``layers`` axis) are channelwise, i.e. one scale per
layer; after them the first axis is the input, and both ``("q_heads", "head_dim")`` of an
attention output kernel ``[H, D, E]``.

When: once per weight version, at the swap (:meth:`QuantizedKernels.quantize`, from
:meth:`rlflow.sampler.engine.RlflowEngine.load_params`), in one jitted call over the
version's kernels. A kernel passed again as the same array (a LoRA forward swap passes its
base every version) keeps its quantized copy.

Where it runs: weight-only (activations stay in the sampler dtype; qwix's ``act_qtype`` is
not used). On TPU and GPU the engine holds the int8 ``QArray`` s and dequantizes them
(``qwix.dequantize``: ``q * scale`` in the sampler dtype) inside each jitted call in front
of their dots: qwix's own path for a float activation times an int8 weight
(``qwix.dot_general`` dequantizes the weight operand: "XLA is able to fuse the dequantize
and the matmul"), so a decode step reads 1 byte a weight plus the scales. XLA:CPU fuses no
dequantize into a dot: inside a decode call it hoists the dequantize out of the
``lax.scan`` and writes a float copy of every kernel per call, and the 135M SmolLM2 decode
step ran 0.6x float32's speed that way (``benchmarks/sampler_throughput.py``, ``int8``
lines). So on the CPU backend (the test bed) the engine dequantizes once per version, at
the swap, and holds the dequantized float kernels: the same values, hence the same policy
and behaviour logprobs, decoded at float32's speed and memory (:func:`holds_float`).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

from rlflow.config.sampler import QUANTIZATIONS
from rlflow.sampler.kernel_layout import weak_ref

#: logical axes of the projections' own input / output sides (rlflow.models.decoder)
PROJECTION_AXES = frozenset({"embed", "mlp", "q_heads", "kv_heads", "head_dim", "vocab"})


def _name(path) -> tuple[str, bool]:
    """A leaf's attribute name and whether it sits inside a LoRA adapter module."""
    keys = [k.key for k in path if hasattr(k, "key")]
    names = [k for k in keys if isinstance(k, str)]
    return (names[-1] if names else ""), any(n.endswith("_lora") for n in names[:-1])


def input_axes(logical: Sequence[str | None], ndim: int) -> tuple[int, ...]:
    """The contracting (input) axes of a projection kernel with logical axes ``logical``.

    Leading axes that are not projection axes (:data:`PROJECTION_AXES`, e.g. a stacking
    ``layers`` axis) are skipped; the next axis is the input, with the following one too
    when it is ``q_heads`` (the attention output kernel ``[H, D, E]`` contracts heads and
    head_dim). Without logical axes (``None``): axis 0.
    """
    if not logical:
        return (0,)
    first = 0
    while first < ndim - 1 and logical[first] not in PROJECTION_AXES:
        first += 1
    return (first, first + 1) if logical[first] == "q_heads" else (first,)


def projection_kernels(state) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The projection kernels of a model's parameter tree (module doc).

    Args:
      state: ``nnx.State`` of ``nnx.Param`` variables (``nnx.split(model, nnx.Param)[1]``).

    Returns: per kernel ``(position in jax.tree_util.tree_leaves(state), channelwise axes)``,
    the channelwise axes being every axis but the input ones (:func:`input_axes`).
    """
    flat = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    out = []
    for i, (path, var) in enumerate(flat):
        name, in_lora = _name(path)
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        if in_lora or not (name.endswith("_kernel") or name == "lm_head") or value.ndim < 2:
            continue
        logical = (var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable)
                   else None)
        contract = input_axes(logical, value.ndim)
        out.append((i, tuple(a for a in range(value.ndim) if a not in contract)))
    return tuple(out)


def quantize_kernel(w, channelwise_axes: Sequence[int]) -> qwix.QArray:
    """``w`` as an int8 ``qwix.QArray``: symmetric absmax, one scale (in ``w``'s dtype) per
    index of ``channelwise_axes``, reduced over the other (input) axes (module doc)."""
    return qwix.quantize(w, jnp.int8, channelwise_axes=tuple(channelwise_axes))


def holds_float(backend: str) -> bool:
    """Whether an engine on ``backend`` holds its int8 kernels dequantized (CPU: module doc)
    rather than as int8 ``QArray`` s dequantized inside each call (TPU, GPU)."""
    return backend == "cpu"


class QuantizedKernels:
    """An engine's projection kernels quantized to int8 once per version: held as
    ``qwix.QArray`` s (``qvalue`` int8 of the kernel's shape, ``scale`` in the kernel's
    dtype with 1 on the input axes), or on the CPU backend as their dequantized values
    (:func:`holds_float`).

    Args:
      state: the model's parameter tree (``nnx.State`` of ``nnx.Param`` variables).
      mode: ``sampler.quantization``: "none" (nothing is quantized) or "int8".
      backend: the engine mesh's platform ("cpu", "tpu", "gpu").

    Raises: ValueError for a mode not in :data:`rlflow.config.sampler.QUANTIZATIONS`.
    """

    def __init__(self, state, mode: str = "none", backend: str = "cpu"):
        if mode not in QUANTIZATIONS:
            raise ValueError(f"sampler.quantization must be one of {list(QUANTIZATIONS)}, "
                             f"got {mode!r}")
        self.mode = mode
        self.kernels = projection_kernels(state) if mode == "int8" else ()
        self.holds_float = holds_float(backend)
        axes = tuple(a for _, a in self.kernels)

        def quantize(xs):
            qs = [quantize_kernel(x, a) for x, a in zip(xs, axes)]
            return [qwix.dequantize(q) for q in qs] if self.holds_float else qs
        self._quantize = jax.jit(quantize)
        self._kept: dict = {}        # leaf position -> (weak ref to the array given, held)

    @property
    def enabled(self) -> bool:
        return bool(self.kernels)

    def quantize(self, given: Sequence, placed: Sequence) -> list:
        """``placed`` (the version's leaves on the engine mesh, model layout) with every
        projection kernel replaced by its int8 ``QArray`` (or its dequantized values,
        :func:`holds_float`), quantized once per version: when every kernel's ``given``
        array (per leaf, the caller's array it comes from, before slicing and placement:
        ``LayerStorage.origins``) is the one of the previous call, the
        quantized copies are kept; else all are quantized again."""
        leaves = list(placed)
        if any(self._kept.get(i, (lambda: None,))[0]() is not given[i]
               for i, _ in self.kernels):
            done = self._quantize([placed[i] for i, _ in self.kernels])
            self._kept = {i: (weak_ref(given[i]), q) for (i, _), q in zip(self.kernels, done)}
        for i, _ in self.kernels:
            leaves[i] = self._kept[i][1]
        return leaves

    def dequantize(self, leaves: Sequence) -> list:
        """Leaves with every ``QArray`` dequantized (``qvalue * scale``, the scale's dtype);
        inside the engine's jitted calls (module doc: where it runs)."""
        return [qwix.dequantize(x) if isinstance(x, qwix.QArray) else x for x in leaves]


def kernel_bytes(leaves: Sequence) -> int:
    """Bytes the given leaves hold on their devices, an int8 ``QArray`` counted as its
    int8 values plus its scales (for the benchmarks and tests)."""
    return int(sum(np.dtype(x.dtype).itemsize * x.size
                   for x in jax.tree.leaves(list(leaves))))
