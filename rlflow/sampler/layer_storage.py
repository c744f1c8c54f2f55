"""How the sampler engine stores the decoder's layers: one array per layer.

The decoder stores its layers stacked (``layers.mlp.up_kernel [L, E, F]``,
:mod:`rlflow.models.layer_scan`), what the learner's scan wants. The sampler's KV-cached
forward runs the layers as a Python loop (each layer has its own KV cache arrays); on the
stacked arrays every layer would take a static slice ``[i]`` of each weight inside the jitted
decode call, and XLA:CPU copies such a slice before its dot: the decode step of the 4.46M
GSM8K model ran 1.2-1.3x slower (3.4 -> 3.9-4.4 ms, ``benchmarks/sampler_throughput.py``
device step, 16 slots). So the engine holds a *view* of the model
(:func:`unstacked_view`): a :class:`rlflow.models.decoder.Decoder` whose ``layers`` is an
``nnx.List`` of ``L`` blocks (per-layer parameter paths ``layers.<i>.mlp.up_kernel``),
which ``Decoder.forward_cached`` runs directly. Each weight version is sliced once, when
the engine loads it (:meth:`LayerStorage.view_leaves`; a stacked array given again, as a
LoRA forward swap passes its base every version, keeps its slices), and stacked back for
:meth:`rlflow.sampler.engine.RlflowEngine.param_state`.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from rlflow.models.layer_pattern import layer_pattern, ordered_layers
from rlflow.models.layer_scan import LAYER_AXIS
from rlflow.sampler.kernel_layout import weak_ref


def unstacked_view(model) -> nnx.Module:
    """A copy of the decoder ``model`` whose ``layers`` is an ``nnx.List`` of its ``L``
    blocks (:func:`rlflow.models.layer_scan.layer_modules`: eager slices); the other
    modules are ``model``'s own (shared, not copied)."""
    graphdef, state = nnx.split(model)
    view = nnx.merge(graphdef, state)          # new module objects over the same arrays
    view.layers = nnx.List(ordered_layers(model.layers, layer_pattern(model.cfg.kinds)))
    return view


def _keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


class LayerStorage:
    """The map between a decoder's parameter leaves (stacked layers, the model's and the
    learner's tree) and the engine's (:func:`unstacked_view`'s, one leaf per layer).

    Args:
      stacked: the model's parameter state (``nnx.State``, stacked layers).
      view: the engine view's parameter state (``nnx.State`` of :func:`unstacked_view`).
      pattern: the model's :class:`rlflow.models.layer_pattern.LayerPattern` when its
        layers come in several kinds (view layer ``i`` is then slice ``j`` of stack
        ``layers.<kind>``, :meth:`LayerPattern.slot`); None: one stack.

    Raises: ValueError when the two trees do not correspond (a view leaf without its
    stacked source).
    """

    def __init__(self, stacked, view, pattern=None):
        multi = pattern is not None and len(pattern.kinds) > 1
        src = {_keys(p): j for j, (p, _) in
               enumerate(jax.tree_util.tree_flatten_with_path(stacked)[0])}
        self.sources: list[tuple[int, int | None]] = []   # per view leaf: (stacked leaf, layer)
        for path, _ in jax.tree_util.tree_flatten_with_path(view)[0]:
            keys = _keys(path)
            layered = keys[:1] == (LAYER_AXIS,) and len(keys) > 1 and isinstance(keys[1], int)
            key, index = keys, None
            if layered:
                kind, index = pattern.slot(keys[1]) if multi else (None, keys[1])
                key = keys[:1] + ((kind,) if multi else ()) + keys[2:]
            if key not in src:
                raise ValueError(f"engine view parameter {'.'.join(map(str, keys))} has no "
                                 f"stacked source {'.'.join(map(str, key))}")
            self.sources.append((src[key], index))
        self.num_stacked = len(src)
        # stacked leaf -> (weak ref to it, weak refs to its per-layer slices): a slice
        # the engine transposed or quantized is not kept alive here (with strong
        # references every version's slices stayed resident beside the engine's
        # transposed kernels, 0.4 GiB for SmolLM2-135M in float32)
        self._kept: dict = {}

    def view_leaves(self, stacked_leaves: Sequence) -> list:
        """The model's leaves -> the view's: slice ``[i]`` of a stacked leaf for layer ``i``
        (eager: one copy per layer; an array given again whose slices are all still alive,
        e.g. held as the engine's leaves, keeps them)."""
        out = []
        sliced: dict = {}
        for j, layer in self.sources:
            x = stacked_leaves[j]
            if layer is None:
                out.append(x)
                continue
            if j not in sliced:
                ref, refs = self._kept.get(j, (lambda: None, ()))
                parts = [r() for r in refs] if ref() is x else []
                if not parts or any(p is None for p in parts):
                    parts = [x[i] for i in range(x.shape[0])]
                    self._kept[j] = (weak_ref(x), [weak_ref(p) for p in parts])
                sliced[j] = parts
            out.append(sliced[j][layer])
        return out

    def origins(self, stacked_leaves: Sequence) -> list:
        """Per view leaf, the model's leaf it comes from (a stacked leaf for every layer's
        slice of it): what the engine's per-version caches key by identity."""
        return [stacked_leaves[j] for j, _ in self.sources]

    def stacked_leaves(self, view_leaves: Sequence) -> list:
        """The view's leaves -> the model's (layers stacked in order: copies)."""
        parts: dict[int, dict[int, object]] = {}
        out: list = [None] * self.num_stacked
        for (j, layer), x in zip(self.sources, view_leaves):
            if layer is None:
                out[j] = x
            else:
                parts.setdefault(j, {})[layer] = x
        for j, layers in parts.items():
            out[j] = jnp.stack([layers[i] for i in range(len(layers))])
        return out
