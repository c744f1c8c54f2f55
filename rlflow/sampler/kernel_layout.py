"""How the sampler engine stores its wide projection kernels: ``[in, out]`` or ``[out, in]``.

The model computes every projection as ``x [rows, in] @ kernel [in, out]``. A *wide* kernel
is a 2-D one with ``in < out``: the SwiGLU gate and up kernels ``[E, F]`` and an untied LM
head ``[E, V]``. On the CPU backend, at the decode step's ``rows = slots`` (16), XLA:CPU's
YNNPACK dot ran such a kernel stored ``[in, out]`` 1.3-1.6x slower (median of interleaved
runs, ``[16, 256] x [256, 1024]`` float32, an AMD EPYC host without AVX-512) than the same
kernel stored ``[out, in]`` and contracted on its second axis, the layout ``transformers``
keeps for ``nn.Linear``; the ``[in, out]`` storage of the narrow down kernel ``[F, E]`` was
as fast as its transpose. A whole decode step of the 4.46M GSM8K model ran 1.18x faster
there (10.13 vs 11.94 ms, ``benchmarks/sampler_throughput.py``, ``_in_out`` lines).

So with layout ``"out_in"`` the engine stores each wide kernel transposed: one transpose per
weight version in :meth:`rlflow.sampler.engine.RlflowEngine.load_params` (a kernel passed
again, as a LoRA forward swap passes its base, keeps its stored copy); inside its jitted
calls it marks the merged model (:meth:`StoredKernels.mark`), whose projections then contract the stored
kernel's second axis with an explicit ``dot_general``. (Handed ``stored.T`` instead,
XLA:CPU copied the kernel back to ``[in, out]`` rather than fold the transpose into the
dot.) ``"auto"`` picks ``"out_in"`` on the CPU backend only: TPU and GPU compilers choose
their own physical layouts.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import jax
import jax.numpy as jnp

from rlflow.config.sampler import KERNEL_LAYOUTS as LAYOUTS
from rlflow.models.layer_scan import LAYER_AXIS


def stores_out_first(layout: str, backend: str) -> bool:
    """Whether wide kernels are stored ``[out, in]``.

    Args:
      layout: ``sampler.kernel_layout``, one of :data:`LAYOUTS`.
      backend: the engine mesh's platform ("cpu", "tpu", "gpu").

    Raises: ValueError for a layout not in :data:`LAYOUTS`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"sampler.kernel_layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return layout == "out_in" or (layout == "auto" and backend == "cpu")


def _keys(path) -> tuple:
    """A parameter's tree path as plain keys: ``('layers', 'mlp', 'gate_kernel')`` (stacked),
    ``('layers', 0, 'mlp', 'gate_kernel')`` (the engine's per-layer view)."""
    return tuple(k.key for k in path if hasattr(k, "key"))


def wide_kernels(state) -> tuple[tuple[int, tuple, str], ...]:
    """The wide kernels of a parameter tree.

    Args:
      state: the model's parameter tree (``nnx.State``): leaves named ``*_kernel`` or
        ``lm_head`` that are 2-D ``[in, out]`` with ``in < out`` are wide, under stacked
        ``layers`` (:mod:`rlflow.models.layer_scan`) after their leading ``[L]`` axis (``[L,
        in, out]``; the engine's per-layer ``layers.<i>`` leaves,
        :mod:`rlflow.sampler.layer_storage`, are 2-D); LoRA factors, embeddings, norms and
        the 3-D attention kernels are not.

    Returns: per wide kernel, ``(position in jax.tree_util.tree_leaves(state), keys of the
    module that owns it, its attribute name)``.
    """
    out = []
    for i, (path, x) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0]):
        keys = _keys(path)
        name = keys[-1] if keys and isinstance(keys[-1], str) else ""
        stacked = keys[:1] == (LAYER_AXIS,) and len(keys) > 1 and not isinstance(keys[1], int)
        shape = tuple(x.shape)[1:] if stacked else tuple(x.shape)
        if ((name.endswith("_kernel") or name == "lm_head") and len(shape) == 2
                and shape[0] < shape[1]):
            out.append((i, keys[:-1], name))
    return tuple(out)


def _flip(x):
    """``[..., in, out] <-> [..., out, in]``: the last two axes swapped (a stacked kernel
    keeps its leading layer axis). A 2-D kernel takes ``.T``, which an int8 ``qwix.QArray``
    (:mod:`rlflow.sampler.quantization`) has too."""
    return x.T if len(x.shape) == 2 else jnp.swapaxes(x, -1, -2)


def weak_ref(x):
    """A weak reference to ``x``, or one that is always dead where ``x`` takes none (the
    engine's per-version caches key the arrays given by identity without keeping them
    alive: here, :mod:`rlflow.sampler.layer_storage`, :mod:`rlflow.sampler.quantization`)."""
    try:
        return weakref.ref(x)
    except TypeError:
        return lambda: None


class StoredKernels:
    """An engine's wide kernels held ``[out, in]``.

    Args:
      wide: :func:`wide_kernels` of the model's parameter tree; empty: nothing is stored
        transposed (layout "in_out", or "auto" off the CPU backend).

    Thread-safe enough for the engine: a race between two :meth:`store` calls costs at
    most one extra transpose.
    """

    def __init__(self, wide: Sequence[tuple] = ()):
        self.wide = tuple(wide)
        # leaf position -> (weak reference to the array given, its stored transpose): the
        # given version is not kept alive for this
        self._kept: dict = {}

    def store(self, given: Sequence, placed: Sequence) -> list:
        """The leaves to keep: ``placed`` (on the engine mesh, ``[in, out]``) with each wide
        kernel transposed, once per array: a kernel whose ``given`` array (per leaf, the
        caller's array it comes from, before slicing and placement:
        ``LayerStorage.origins``) is the one of the previous call keeps its stored copy (a LoRA
        forward swap passes the same base every version). ``placed`` is taken over: a list
        given is updated in place, so each kernel's ``[in, out]`` array is dropped as soon as
        its transpose exists (a whole version's worth of both never coexists)."""
        leaves = placed if isinstance(placed, list) else list(placed)
        for i, _, _ in self.wide:
            src, kept = self._kept.get(i, (lambda: None, None))
            if src() is not given[i]:
                kept = _flip(placed[i])
                self._kept[i] = (weak_ref(given[i]), kept)
            leaves[i] = kept
        return leaves

    def model_leaves(self, leaves: Sequence) -> list:
        """Stored leaves -> the model's own layout (eager: copies; traced: transposes)."""
        at = {i for i, _, _ in self.wide}
        return [_flip(x) if i in at else x for i, x in enumerate(leaves)]

    def mark(self, model) -> None:
        """Tell the modules of ``model`` (merged from stored leaves, inside a jitted call)
        which of their kernels are held ``[out, in]``: each owner's ``out_in`` set
        (:class:`rlflow.models.decoder.MLP`, ``Decoder``) gains the kernel's name, and its
        projection contracts that kernel's second axis."""
        for _, owner, name in self.wide:
            module = model
            for key in owner:
                module = module[key] if isinstance(key, int) else getattr(module, key)
            module.out_in = module.out_in | {name}
