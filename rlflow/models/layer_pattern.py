"""Decoders whose layers come in several kinds, run as a repeating cycle.

Heterogeneous families interleave kinds of layer: Gemma 3 five sliding-window layers per
global one (``[sliding x5, full]``), gpt-oss ``[sliding, full]``, Qwen3.5 three linear
attention (gated DeltaNet) layers per full one. HF names each layer's kind in
``layer_types``; :func:`layer_pattern` finds the shortest cycle ``C`` (``P`` layers) that
repeats through the ``L`` layers, ``L = n P + r``.

Storage: one stacked module per kind (:func:`rlflow.models.layer_scan.stack_modules`; its
variables ``[L_kind, ...]``, the kind's layers in order), held by :class:`LayerKinds` under
the kind's name: ``layers.sliding_attention.attn.q_kernel [L_s, E, H, D]``. A decoder of one
kind keeps its single stack as ``layers`` itself (``layers.attn.q_kernel [L, ...]``): dense
Llama / Qwen and Qwen3-MoE are the cycle of one they always were, and their checkpoints
restore unchanged. Layer ``i`` is slice ``j`` of its kind's stack (:meth:`LayerPattern.slot`).

Forward (:func:`scan_pattern`): one ``jax.lax.scan`` over the ``n`` cycles whose body runs the
``P`` layers of one cycle in order (each kind's stack viewed ``[n, count, ...]``, ``count``
its layers per cycle), then the ``r`` remainder layers (the first ``r`` kinds of the cycle)
one by one. The compiled program holds ``P + r < 2P`` layer bodies whatever ``L``: compile
time stays flat in depth. A new kind of block (``"linear_attention"``) only needs its
block class: the pattern does not care what a kind's block holds.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
from flax import nnx

from rlflow.models.layer_scan import _layer, checkpoint_policy, layer_modules, scan_layers


class LayerPattern(NamedTuple):
    """The cycle of layer kinds of a decoder.

    Attributes:
      cycle: the kinds of one cycle, ``P`` of them (the shortest that repeats).
      num_layers: ``L``.
    """
    cycle: tuple[str, ...]
    num_layers: int

    @property
    def kinds(self) -> tuple[str, ...]:
        """The distinct kinds, in the order they first occur."""
        return tuple(dict.fromkeys(self.cycle))

    @property
    def cycles(self) -> int:
        """``n``: whole cycles."""
        return self.num_layers // len(self.cycle)

    @property
    def remainder(self) -> int:
        """``r``: layers after the last whole cycle (the cycle's first ``r`` kinds)."""
        return self.num_layers % len(self.cycle)

    def kind(self, i: int) -> str:
        return self.cycle[i % len(self.cycle)]

    def per_cycle(self, kind: str) -> int:
        return self.cycle.count(kind)

    def rank(self, p: int) -> int:
        """Index of cycle position ``p`` among the cycle's positions of its kind."""
        return self.cycle[:p].count(self.cycle[p])

    def slot(self, i: int) -> tuple[str, int]:
        """``(kind, j)``: layer ``i`` is slice ``j`` of its kind's stack."""
        c, p = divmod(i, len(self.cycle))
        kind = self.cycle[p]
        return kind, c * self.per_cycle(kind) + self.rank(p)

    def count(self, kind: str) -> int:
        """Layers of ``kind`` (the length of its stack)."""
        return sum(1 for i in range(self.num_layers) if self.kind(i) == kind)


def layer_pattern(kinds) -> LayerPattern:
    """The shortest cycle ``C`` with ``kinds[i] == C[i % len(C)]`` for every layer.

    Args:
      kinds: the kind of each layer (``DecoderConfig.kinds``), at least one.

    Raises:
      ValueError: no layers.
    """
    kinds = tuple(kinds)
    if not kinds:
        raise ValueError("a decoder needs at least one layer (num_layers >= 1)")
    for p in range(1, len(kinds) + 1):
        if all(kinds[i] == kinds[i % p] for i in range(len(kinds))):
            return LayerPattern(kinds[:p], len(kinds))
    raise AssertionError("unreachable: the whole sequence is a cycle")


class LayerKinds(nnx.Module):
    """The stacks of a decoder of several layer kinds: attribute ``<kind>`` is that kind's
    stacked module (module doc)."""

    def __init__(self, stacks: dict):
        for kind, stack in stacks.items():
            setattr(self, kind, stack)


def is_multi_kind(layers) -> bool:
    return isinstance(layers, LayerKinds)


def ordered_layers(layers, pattern: LayerPattern) -> list[nnx.Module]:
    """The ``L`` layers in order, each a module of one layer (static slices of its kind's
    stack, :func:`rlflow.models.layer_scan.layer_modules`)."""
    if not is_multi_kind(layers):
        return layer_modules(layers)
    per_kind = {k: layer_modules(getattr(layers, k)) for k in pattern.kinds}
    return [per_kind[k][j] for k, j in map(pattern.slot, range(pattern.num_layers))]


def scan_pattern(layers, pattern: LayerPattern, x, apply: Callable, remat: str = "none",
                 xs=None):
    """``x`` through every layer in order (module doc): as
    :func:`rlflow.models.layer_scan.scan_layers` (same arguments, ``xs`` per-layer inputs
    ``[L, ...]`` in layer order, per-layer outputs ``ys`` ``[L, ...]`` in layer order), for
    a single stack or a :class:`LayerKinds`.

    Raises:
      LayerScanError: see :func:`rlflow.models.layer_scan.checkpoint_policy`.
    """
    if not is_multi_kind(layers):
        return scan_layers(layers, x, apply, remat, xs)
    policy = checkpoint_policy(remat)
    n, size = pattern.cycles, len(pattern.cycle)
    split = {k: nnx.split(getattr(layers, k)) for k in pattern.kinds}

    def one(graphdef, state, carry, per_layer):
        layer = _layer(graphdef, state)
        return (apply(layer, carry), None) if xs is None else apply(layer, carry, per_layer)

    def run(kind, state, carry, per_layer):
        fn = lambda s, c, y: one(split[kind][0], s, c, y)   # noqa: E731
        if remat != "none":
            fn = jax.checkpoint(fn, policy=policy, prevent_cse=False)
        return fn(state, carry, per_layer)

    def body(carry, inputs):
        states, per_layer = inputs
        ys = []
        for p, kind in enumerate(pattern.cycle):
            state = jax.tree.map(lambda a, r=pattern.rank(p): a[r], states[kind])
            carry, y = run(kind, state, carry,
                           None if xs is None else jax.tree.map(lambda a, p=p: a[p], per_layer))
            ys.append(y)
        return carry, (None if xs is None else jax.tree.map(lambda *a: jax.numpy.stack(a), *ys))

    head = {k: jax.tree.map(lambda a, c=pattern.per_cycle(k): a[:n * c].reshape(
        (n, c) + a.shape[1:]), split[k][1]) for k in pattern.kinds}
    head_xs = None if xs is None else jax.tree.map(
        lambda a: a[:n * size].reshape((n, size) + a.shape[1:]), xs)
    ys = None
    if n:
        x, ys = jax.lax.scan(body, x, (head, head_xs))
        if xs is not None:
            ys = jax.tree.map(lambda a: a.reshape((n * size,) + a.shape[2:]), ys)
    tail = []
    for p in range(pattern.remainder):
        kind, j = pattern.slot(n * size + p)
        state = jax.tree.map(lambda a, j=j: a[j], split[kind][1])
        x, y = run(kind, state, x, None if xs is None else jax.tree.map(
            lambda a, i=n * size + p: a[i], xs))
        tail.append(y)
    if xs is None:
        return x
    if tail:
        rest = jax.tree.map(lambda *a: jax.numpy.stack(a), *tail)
        ys = rest if ys is None else jax.tree.map(
            lambda a, b: jax.numpy.concatenate([a, b]), ys, rest)
    return x, ys
