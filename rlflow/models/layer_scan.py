"""The decoder's layers under one ``jax.lax.scan``, with rematerialisation policies.

The full-sequence forward (the learner's) runs its ``L`` homogeneous layers as a scan over
their parameters stacked along a leading ``layers`` axis, so XLA compiles one layer body
whatever the depth (MaxText's ``scan_layers``). Storage stays per layer (``layers[i]``, what
the sampler, HF import/export, LoRA, checkpoints and the transfer layout address): each
:class:`rlflow.models.decoder.Block` is split (``nnx.split``) inside the traced forward,
the per-layer states are stacked with ``jnp.stack`` and the scan body merges one slice back
(``nnx.merge``). Stacking is differentiable, so gradients flow back to the per-layer
parameters unchanged, and LoRA adapters, which live inside the blocks, follow.

Rematerialisation (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost";
``jax.checkpoint``): the scan body is wrapped in ``jax.checkpoint`` with one of
:data:`REMAT_POLICIES`:

* ``"none"``: no checkpoint: the backward pass keeps every intermediate of every layer
  (attention scores ``[B, H, T, T]`` included);
* ``"full"``: ``jax.checkpoint_policies.nothing_saveable``: only each layer's input (the
  residual carry ``[B, T, E]``) is kept; the backward recomputes that layer's forward
  (about one extra forward pass: ~4/3 of the step's FLOPs);
* ``"dots"``: ``dots_with_no_batch_dims_saveable``: the outputs of the projections (2-D
  matmuls, :func:`rlflow.models.decoder._dense`) are kept, the elementwise work and the
  attention's batched dots (the ``[T, T]`` scores and probabilities) are recomputed;
* ``"offload"``: ``offload_dot_with_no_batch_dims("device", "pinned_host")``: the same
  projection outputs, moved to host memory during the forward and back for the backward
  (HBM holds about what ``"full"`` holds; costs host bandwidth). Needs a backend whose
  devices have a ``pinned_host`` memory space (TPU, GPU; jax's CPU client has one too).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

REMAT_POLICIES = ("none", "full", "dots", "offload")


class LayerScanError(ValueError):
    """The layers cannot run under one scan (their structures differ), or a remat policy is
    unknown or unsupported on this backend."""


def checkpoint_policy(remat: str):
    """The ``jax.checkpoint`` policy of a :data:`REMAT_POLICIES` name (None for ``"none"``).

    Raises:
      LayerScanError: an unknown name, or ``"offload"`` on devices without a
        ``pinned_host`` memory space (names ``learner.remat`` and the alternatives).
    """
    cp = jax.checkpoint_policies
    if remat == "none":
        return None
    if remat == "full":
        return cp.nothing_saveable
    if remat == "dots":
        return cp.dots_with_no_batch_dims_saveable
    if remat == "offload":
        kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
        if "pinned_host" not in kinds:
            raise LayerScanError(
                f"learner.remat='offload' needs a 'pinned_host' memory space on the "
                f"{jax.default_backend()} backend (its devices have {sorted(kinds)}); use "
                f"'full' (recompute, no host copies) or 'dots'")
        return cp.offload_dot_with_no_batch_dims("device", "pinned_host")
    raise LayerScanError(f"learner.remat must be one of {', '.join(REMAT_POLICIES)}, "
                         f"got {remat!r}")


def stack_layers(layers) -> tuple[nnx.GraphDef, nnx.State]:
    """The shared graphdef of ``layers`` and their states stacked along a new axis 0.

    Args:
      layers: a sequence of ``L >= 1`` nnx modules of the same structure (the decoder's
        blocks).

    Returns:
      ``(graphdef, state)``: every leaf of ``state`` is ``[L, ...]``, slice ``i`` being layer
      ``i``'s leaf (same dtype).

    Raises:
      LayerScanError: the layers' graphdefs differ (naming the first that differs from
        layer 0).
    """
    splits = [nnx.split(layer) for layer in layers]
    graphdef = splits[0][0]
    for i, (g, _) in enumerate(splits[1:], start=1):
        if g != graphdef:
            raise LayerScanError(
                f"decoder layer {i} has another structure than layer 0 (parameters, LoRA "
                f"adapters or static attributes differ), so the layers cannot run under one "
                f"scan; give every layer the same structure")
    state = jax.tree.map(lambda *xs: jnp.stack(xs), *(s for _, s in splits))
    return graphdef, state


def scan_layers(layers, x: jax.Array, apply: Callable, remat: str = "none", xs=None):
    """``x`` through every layer in order, as one ``jax.lax.scan`` (module doc).

    Args:
      layers: the decoder's blocks (:func:`stack_layers`).
      x: the residual stream ``[B, T, E]`` (any float dtype).
      apply: ``apply(layer, x) -> x`` for one layer (the other arguments closed over; they
        are the same for every layer).
      remat: one of :data:`REMAT_POLICIES`.
      xs: optional per-layer inputs, a pytree of ``[L, ...]`` arrays (e.g. rollout routing
        replay's recorded expert ids); then ``apply(layer, x, xs_i) -> (x, ys_i)``.

    Returns:
      The last layer's output, shaped and typed as ``x``; equal to
      ``for layer in layers: x = apply(layer, x)`` (the same operations per layer). With
      ``xs``: ``(x, ys)``, ``ys`` the per-layer outputs stacked ``[L, ...]``.

    Raises:
      LayerScanError: see :func:`stack_layers` and :func:`checkpoint_policy`.
    """
    policy = checkpoint_policy(remat)
    graphdef, stacked = stack_layers(layers)

    def body(carry, inputs):
        layer_state, per_layer = inputs
        layer = nnx.merge(graphdef, layer_state)
        if xs is None:
            return apply(layer, carry), None
        return apply(layer, carry, per_layer)

    if remat != "none":
        # prevent_cse=False: inside a scan the loop boundary already keeps XLA from fusing
        # the recomputation into the forward (jax.checkpoint's documentation)
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    out, ys = jax.lax.scan(body, x, (stacked, xs))
    return out if xs is None else (out, ys)
