"""The decoder's layers stored stacked and run under one ``jax.lax.scan``, with
rematerialisation policies.

Storage (MaxText's scanned decoder): ``Decoder.layers`` is ONE module of the structure of a
:class:`rlflow.models.decoder.Block` whose every variable (kernels, norm scales, LoRA
adapters, whatever a block holds) has a leading ``[L, ...]`` axis, slice ``i`` being layer
``i``; its logical axis name is :data:`LAYER_AXIS` (``"layers"``, never sharded:
``rlflow.mesh``). :func:`stack_modules` builds it from ``L`` modules of one structure once, at
construction, so it does not care what a block holds. Parameter paths lose the layer index
(``layers.attn.q_kernel`` ``[L, E, H, D]``); the outside world's per-layer names (HF
``model.layers.{i}.``, PEFT, checkpoints written before the stacking) convert at the
boundary with :func:`stack_trees` / :func:`unstack_tree`.

The full-sequence forward (the learner's) scans over the stored stacked state directly
(:func:`scan_layers`): XLA compiles one layer body whatever the depth, and the gradient of
the stacked parameters comes out of the scan stacked (no per-layer slices or stacks in the
program; the optimiser updates ``O(1)`` leaves per kind of parameter, not ``O(L)``). The
cached forward (the sampler's) loops over :func:`layer_modules` (one static slice per
layer: each layer keeps its own KV cache arrays).

Rematerialisation (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost";
``jax.checkpoint``): the scan body is wrapped in ``jax.checkpoint`` with one of
:data:`REMAT_POLICIES`:

* ``"none"``: no checkpoint: the backward pass keeps every intermediate of every layer
  (attention scores ``[B, H, T, T]`` included);
* ``"full"``: ``jax.checkpoint_policies.nothing_saveable``: only each layer's input (the
  residual carry ``[B, T, E]``) is kept; the backward recomputes that layer's forward
  (about one extra forward pass: ~4/3 of the step's FLOPs);
* ``"dots"``: ``dots_with_no_batch_dims_saveable``: the outputs of the projections (2-D
  matmuls, :func:`rlflow.models.linear._dense`) are kept, the elementwise work and the
  attention's batched dots (the ``[T, T]`` scores and probabilities) are recomputed;
* ``"offload"``: ``offload_dot_with_no_batch_dims("device", "pinned_host")``: the same
  projection outputs, moved to host memory during the forward and back for the backward
  (HBM holds about what ``"full"`` holds; costs host bandwidth). Needs a backend whose
  devices have a ``pinned_host`` memory space (TPU, GPU; jax's CPU client has one too).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REMAT_POLICIES = ("none", "full", "dots", "offload")
LAYER_AXIS = "layers"
"""Logical axis name of the leading ``[L]`` axis of the stacked layers' variables."""


class LayerScanError(ValueError):
    """The layers cannot be stacked (their structures differ), or a remat policy is unknown
    or unsupported on this backend."""


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


def _axis_metadata() -> dict:
    return {nnx.PARTITION_NAME: LAYER_AXIS}


def stack_modules(modules: Sequence[nnx.Module]) -> nnx.Module:
    """One module of the modules' structure holding all of them stacked (module doc).

    Args:
      modules: ``L >= 1`` nnx modules of the same structure (the decoder's blocks, built one
        after the other from the same ``nnx.Rngs``).

    Returns:
      A module of ``modules[0]``'s structure whose every variable is ``[L, ...]`` (slice
      ``i`` is ``modules[i]``'s, same dtype), its ``out_sharding`` metadata (logical axes)
      led by :data:`LAYER_AXIS`. Do not call it as a block: run it with
      :func:`scan_layers` or :func:`layer_modules`.

    Raises:
      LayerScanError: no module, or a module's structure (parameters, LoRA adapters, static
        attributes) differs from the first's (names the first that differs).
    """
    if not modules:
        raise LayerScanError("a decoder needs at least one layer (num_layers >= 1)")
    splits = [nnx.split(m) for m in modules]
    graphdef = splits[0][0]
    for i, (g, _) in enumerate(splits[1:], start=1):
        if g != graphdef:
            raise LayerScanError(
                f"decoder layer {i} has another structure than layer 0 (parameters, LoRA "
                f"adapters or static attributes differ), so the layers cannot be stored "
                f"stacked and run under one scan; give every layer the same structure")
    stacked = nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *(s for _, s in splits)))
    nnx.spmd.add_axis(nnx.state(stacked), 0, _axis_metadata())
    return stacked


def num_layers(stacked: nnx.Module) -> int:
    """``L``: the leading axis of a stacked module's variables."""
    return int(jax.tree.leaves(nnx.state(stacked))[0].shape[0])


def _layer(graphdef: nnx.GraphDef, layer_state) -> nnx.Module:
    """A stacked module's graphdef merged with one layer's slice of its state, the
    :data:`LAYER_AXIS` taken off the variables' logical axes (what one block has)."""
    layer = nnx.merge(graphdef, layer_state)
    nnx.spmd.remove_axis(nnx.state(layer), 0, _axis_metadata())
    return layer


def layer_modules(stacked: nnx.Module) -> list[nnx.Module]:
    """The ``L`` layers of a stacked module, each a module of one layer's shapes whose
    variables are static slices ``[i]`` of the stacked ones (inside ``jit``: slices in the
    program; eagerly: copies). For per-layer Python loops (the KV-cached forward)."""
    graphdef, state = nnx.split(stacked)
    return [_layer(graphdef, jax.tree.map(lambda x, i=i: x[i], state))
            for i in range(num_layers(stacked))]


def scan_layers(stacked: nnx.Module, x: jax.Array, apply: Callable, remat: str = "none",
                xs=None):
    """``x`` through every layer in order, as one ``jax.lax.scan`` over the stored stacked
    state (module doc).

    Args:
      stacked: the decoder's stacked blocks (:func:`stack_modules`).
      x: the residual stream ``[B, T, E]`` (any float dtype).
      apply: ``apply(layer, x) -> x`` for one layer (the other arguments closed over; they
        are the same for every layer).
      remat: one of :data:`REMAT_POLICIES`.
      xs: optional per-layer inputs, a pytree of ``[L, ...]`` arrays (e.g. rollout routing
        replay's recorded expert ids); then ``apply(layer, x, xs_i) -> (x, ys_i)``.

    Returns:
      The last layer's output, shaped and typed as ``x``; equal to
      ``for layer in layer_modules(stacked): x = apply(layer, x)`` (the same operations per
      layer). With ``xs`` (a tree of ``[L, ...]`` per-layer inputs): ``apply(layer, x,
      xs_i) -> (x, y_i)`` and the result is ``(x, ys)``, ``ys`` the per-layer outputs
      stacked ``[L, ...]``.

    Raises:
      LayerScanError: see :func:`checkpoint_policy`.
    """
    policy = checkpoint_policy(remat)
    graphdef, state = nnx.split(stacked)

    def body(carry, inputs):
        layer_state, per_layer = inputs
        layer = _layer(graphdef, layer_state)
        if xs is None:
            return apply(layer, carry), None
        return apply(layer, carry, per_layer)

    if remat != "none":
        # prevent_cse=False: inside a scan the loop boundary already keeps XLA from fusing
        # the recomputation into the forward (jax.checkpoint's documentation)
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    out, ys = jax.lax.scan(body, x, (state, xs))
    return out if xs is None else (out, ys)


# ------------------------------------------------------------------------------ boundaries
def stack_trees(trees: Sequence) -> object:
    """Per-layer trees (the same structure, e.g. pure dicts of one layer's arrays) -> one
    tree of ``[L, ...]`` leaves; numpy leaves stay numpy (host memory), others become jax
    arrays. The inverse of :func:`unstack_tree`.

    Raises:
      LayerScanError: no tree, or the trees' structures or a leaf's shapes differ (names the
        layer).
    """
    if not trees:
        raise LayerScanError("no layers to stack")
    ref = jax.tree.structure(trees[0])
    for i, t in enumerate(trees[1:], start=1):
        if jax.tree.structure(t) != ref:
            raise LayerScanError(f"layer {i}'s tree differs from layer 0's: {jax.tree.structure(t)} "
                                 f"vs {ref}")

    def stack(*xs):
        shapes = {tuple(np.shape(x)) for x in xs}
        if len(shapes) != 1:
            raise LayerScanError(f"the layers' arrays differ in shape ({sorted(shapes)}); "
                                 f"cannot stack them")
        if all(isinstance(x, np.ndarray) for x in xs):
            return np.stack(xs)
        return jnp.stack([jnp.asarray(x) for x in xs])

    return jax.tree.map(stack, *trees)


def unstack_tree(tree) -> list:
    """A tree of ``[L, ...]`` leaves -> ``L`` trees of one layer's leaves (``x[i]``; numpy
    stays numpy). The inverse of :func:`stack_trees`."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return []
    return [jax.tree.map(lambda x, i=i: x[i], tree) for i in range(int(np.shape(leaves[0])[0]))]
