"""Sampler side of adapter-only weight sync: the base is held once, each published version
is only the LoRA adapter tree, turned here into the engine's parameters.

Two ways to apply a version (``learner.lora.swap``), both swapped in through
``ContinuousBatcher.update_params`` (same in-flight swap, version tags and staleness rules
as full weights):

* ``"forward"``: the engine runs the LoRA decoder (a low-rank term ``s (x A) B`` in every
  targeted projection); a swap replaces the adapter leaves, the base arrays are shared.
* ``"merged"``: the engine runs the plain decoder on ``W + s A @ B`` for the adapted
  kernels, formed at swap time (in the puller thread) from the *unmerged* base each time,
  so swaps never accumulate rounding; the base stays beside the merged working copy.

``benchmarks/lora_sync.py`` measures both (decode step time, swap time).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlflow.models.lora import LoraSpec, adapter_pairs, delta, full_trained
from rlflow.models.lora_decoder import lora_model_parts


class AdapterApplier:
    """Adapter trees -> engine parameters for one sampler.

    Args:
      model: the base :class:`rlflow.models.decoder.Decoder` (its arrays become the base).
      decoder_cfg: its :class:`DecoderConfig`.
      spec: :class:`rlflow.models.lora.LoraSpec` (the learner's).
      mode: "forward" or "merged".
      mesh: the sampler's mesh (adapters are laid out like their kernels).

    Attributes:
      engine_model: the model to build the engine with (LoRA decoder with fresh, B = 0
        adapters, or the base decoder itself).
      target: an adapter tree (``nnx.State``) with the shapes, dtypes and shardings a pulled
        version must have (the weight subscriber's target).

    Raises: ValueError for an unknown ``mode``.
    """

    def __init__(self, model, decoder_cfg, spec: LoraSpec, mode: str = "forward", mesh=None):
        if mode not in ("forward", "merged"):
            raise ValueError(f"learner.lora.swap must be 'forward' or 'merged', got {mode!r}")
        self.spec, self.mode = spec, mode
        self.graphdef, adapters, self.base = lora_model_parts(model, decoder_cfg, spec,
                                                              mesh=mesh)
        self.target = adapters              # B = 0: the base model's function
        if mode == "forward":
            self.engine_model = nnx.merge(self.graphdef, self.target, self.base)
            # a swap replaces the adapter leaves of the engine's flat parameter list
            full = nnx.state(self.engine_model, nnx.Param)
            paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(full)[0]]
            index = {jax.tree_util.keystr(p): i for i, p in enumerate(paths)}
            self._full_leaves = jax.tree.leaves(full)
            self._full_treedef = jax.tree.structure(full)
            self._slots = [index[jax.tree_util.keystr(p)] for p, _ in
                           jax.tree_util.tree_flatten_with_path(adapters)[0]]
        else:
            self.engine_model = model
            self._plain = nnx.state(model, nnx.Param)     # the unmerged base, whole
            self._paths = [p for p, _, _, _ in adapter_pairs(adapters)]
            self._kernels = [self._get(self._plain, p) for p in self._paths]
            scale = spec.scale
            self._merge = jax.jit(lambda ws, pairs: [
                (w.astype(jnp.float32) + delta(a, b, scale, stacked=True)).astype(w.dtype)
                for w, (a, b) in zip(ws, pairs)])

    @staticmethod
    def _get(state, path):
        for k in path:
            state = state[k]
        return state[...]

    def engine_params(self, adapters):
        """The engine's parameters (``nnx.State``, for ``ContinuousBatcher.update_params``)
        for one adapter version.

        Raises: ValueError when ``adapters`` does not have the learner's adapter tree.
        """
        if jax.tree.structure(adapters) != jax.tree.structure(self.target):
            raise ValueError(f"adapter tree does not match learner.lora (expected "
                             f"{jax.tree.structure(self.target)}, got "
                             f"{jax.tree.structure(adapters)})")
        if self.mode == "forward":
            leaves = list(self._full_leaves)
            for i, x in zip(self._slots, jax.tree.leaves(adapters)):
                leaves[i] = x
            return jax.tree.unflatten(self._full_treedef, leaves)
        pairs = [(a, b) for _, _, a, b in adapter_pairs(adapters)]
        merged = self._merge(self._kernels, [(jnp.asarray(a), jnp.asarray(b)) for a, b in pairs])
        pure = jax.tree.map(lambda x: x, self._plain.to_pure_dict())   # new containers
        for path, w in zip(self._paths, merged):
            node = pure
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = w
        # learner.lora.train_final_norm / train_embeddings: whole modules replace the base's
        for name, value in full_trained(adapters).items():
            pure[name] = value
        state = jax.tree.map(lambda x: x, self._plain)
        nnx.replace_by_pure_dict(state, pure)
        return state
