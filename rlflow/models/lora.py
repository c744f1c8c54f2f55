"""LoRA adapters on the decoder's projections (Hu et al. 2021, "LoRA", sec. 4.1, eq. 3).

A targeted projection with frozen kernel ``W`` (rlflow layout ``[in..., out...]``, e.g.
``q [E, H, D]``, ``o [H, D, E]``) computes ``x @ W + (alpha / r) * (x @ A) @ B`` with
``A [in..., r]`` and ``B [r, out...]``; the merged kernel is ``W + (alpha / r) * A @ B``
(contracting the rank axis), the same layout as ``W``. ``A`` starts like PEFT's
(``kaiming_uniform(a=sqrt(5))``: uniform in ``+-1/sqrt(fan_in)``), ``B`` at zero, so a fresh
adapter leaves the model's function unchanged exactly (``x @ A @ 0 = 0``).

Adapter matrices are ``flax.nnx.LoRAParam`` (a subclass of ``nnx.Param``) with logical axes
(the kernel's input axes + ``"lora_rank"``, ``"lora_rank"`` + its output axes), so
``nnx.split(model, nnx.LoRAParam, nnx.Param)`` separates the trainable adapters from the
frozen base, and ``rlflow.mesh.param_shardings`` lays them out like their kernels.

The adapters live beside the kernels they modify (``layers.attn.q_lora`` next to
``layers.attn.q_kernel``; ``layers.mlp.gate_lora`` next to ``gate_kernel``), stacked with
them over the layers (:mod:`rlflow.models.layer_scan`): ``A [L, in..., r]``, ``B [L, r,
out...]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTN = ("q", "k", "v", "o")
MLP = ("gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Static LoRA settings of a decoder (hashable: part of the model's graph).

    rank: r > 0. alpha: the adapter term is scaled by ``alpha / rank``.
    projections: targeted HF projection names (a subset of :data:`PROJECTIONS`).
    """
    rank: int
    alpha: float
    projections: tuple[str, ...] = PROJECTIONS
    train_final_norm: bool = False
    train_embeddings: bool = False

    def __post_init__(self):
        if self.rank <= 0:
            raise ValueError(f"LoraSpec.rank must be > 0, got {self.rank}")
        bad = [p for p in self.projections if p not in PROJECTIONS]
        if bad or not self.projections:
            raise ValueError(f"LoraSpec.projections must be a non-empty subset of {PROJECTIONS}, "
                             f"got {self.projections}")

    @property
    def scale(self) -> float:
        return float(self.alpha) / float(self.rank)

    def targets(self, name: str) -> bool:
        """``name``: a short projection name (``"q"``, ``"gate"``)."""
        return f"{name}_proj" in self.projections

    @classmethod
    def from_config(cls, lora_cfg) -> "LoraSpec | None":
        """From a :class:`rlflow.config.LoraConfig` (None when ``rank`` is 0)."""
        if not lora_cfg.enabled:
            return None
        return cls(rank=lora_cfg.rank, alpha=float(lora_cfg.alpha),
                   projections=lora_cfg.projections,
                   train_final_norm=bool(getattr(lora_cfg, "train_final_norm", False)),
                   train_embeddings=bool(getattr(lora_cfg, "train_embeddings", False)))

    def trainable(self):
        """The ``nnx`` filter of the trained parameters: the adapters (``nnx.LoRAParam``),
        with ``train_final_norm`` the final RMSNorm scale, with ``train_embeddings`` the
        token embedding and an untied ``lm_head``."""
        full = self.full_modules()
        if not full:
            return nnx.LoRAParam
        return nnx.Any(nnx.LoRAParam, *(nnx.All(nnx.Param, nnx.PathContains(m)) for m in full))

    def full_modules(self) -> tuple[str, ...]:
        """Top-level decoder modules trained whole beside the adapters (PEFT
        ``modules_to_save``): ``final_norm``, ``embed``, ``lm_head``."""
        return ((("final_norm",) if self.train_final_norm else ())
                + (("embed", "lm_head") if self.train_embeddings else ()))


class LoraAdapter(nnx.Module):
    """``x [..., *in_shape] -> scale * (x @ A) @ B  [..., *out_shape]``.

    Args:
      in_shape / out_shape: the kernel's input / output dimensions (``(E,)`` and ``(H, D)``
        for ``q``). in_axes / out_axes: their logical axis names.
      spec: :class:`LoraSpec`. param_dtype: storage dtype of A and B (the decoder uses
        float32 whatever the base's dtype: they are trained); dtype: compute dtype.
    """

    def __init__(self, in_shape, out_shape, in_axes, out_axes, spec: LoraSpec, param_dtype,
                 dtype, *, rngs: nnx.Rngs):
        fan_in = math.prod(in_shape)
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(rngs.params(), (*in_shape, spec.rank), jnp.float32, -bound, bound)
        self.a = nnx.LoRAParam(a.astype(param_dtype), out_sharding=(*in_axes, "lora_rank"),
                               eager_sharding=False)
        self.b = nnx.LoRAParam(jnp.zeros((spec.rank, *out_shape), param_dtype),
                               out_sharding=("lora_rank", *out_axes), eager_sharding=False)
        self.n_in = len(in_shape)
        self.scale = spec.scale
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jnp.tensordot(x, self.a[...].astype(self.dtype), axes=self.n_in)      # [..., r]
        return jnp.tensordot(h, self.b[...].astype(self.dtype), axes=1) * jnp.asarray(
            self.scale, self.dtype)


# ------------------------------------------------------------------------------ trees
def split_lora(model, spec: LoraSpec | None = None):
    """``(graphdef, adapters, base)`` of a LoRA decoder: the trained parameters
    (:meth:`LoraSpec.trainable`; default: the ``nnx.LoRAParam``) and the frozen rest."""
    return nnx.split(model, (spec or model.lora).trainable(), nnx.Param)


def _pure(tree):
    return tree.to_pure_dict() if isinstance(tree, nnx.State) else tree


def adapter_pairs(adapters) -> list[tuple[tuple, str, object, object]]:
    """``(kernel path, hf projection name, A, B)`` for every adapter of a (pure-dict or
    ``nnx.State``) adapter tree, attention projections first; ``kernel path`` is the stacked
    base parameter the adapter modifies, e.g. ``("layers", "attn", "q_kernel")``, and ``A [L,
    in..., r]``, ``B [L, r, out...]`` hold every layer's factors (slice ``i``: layer ``i``)."""
    pure = _pure(adapters)
    out = []
    layers = pure.get("layers", {})
    for mod, names in (("attn", ATTN), ("mlp", MLP)):
        for n in names:
            ad = layers.get(mod, {}).get(f"{n}_lora")
            if ad:
                out.append((("layers", mod, f"{n}_kernel"), f"{n}_proj", ad["a"], ad["b"]))
    return out


def delta(a, b, scale: float, dtype=jnp.float32, *, stacked: bool = False):
    """``scale * A @ B`` contracting the rank axis: ``[in..., r] x [r, out...] -> [in...,
    out...]`` (float32 accumulation, cast to ``dtype``); ``stacked``: per layer, ``[L, in...,
    r] x [L, r, out...] -> [L, in..., out...]`` (:func:`adapter_pairs`' factors)."""
    def one(a, b):
        return jnp.tensordot(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), axes=1)
    d = jax.vmap(one)(a, b) if stacked else one(a, b)
    return (d * jnp.float32(scale)).astype(dtype)


def merged_params(base, adapters, scale: float):
    """The plain decoder's parameters ``W + scale * A @ B`` for every adapted kernel (others:
    the base's own arrays). Never modifies ``base``: each call starts from the unmerged base,
    so repeated merges of new adapter versions do not accumulate.

    Args:
      base: ``nnx.State`` (or pure dict) of the base decoder's parameters.
      adapters: the adapter tree (``nnx.State`` or pure dict).
      scale: ``alpha / rank``.

    Returns: a pure dict shaped like ``base`` (kernels in the base's dtypes; the sum is formed
    in float32). Modules trained whole (a final norm, embeddings: :func:`full_trained`)
    replace the base's.
    """
    pure = jax.tree.map(lambda x: x, _pure(base))       # new containers, same leaves
    for name, value in full_trained(adapters).items():
        pure[name] = jax.tree.map(lambda new, old: jnp.asarray(new).astype(old.dtype), value,
                                  pure[name])
    for path, _, a, b in adapter_pairs(adapters):
        node = pure
        for k in path[:-1]:
            node = node[k]
        w = node[path[-1]]
        node[path[-1]] = (jnp.asarray(w, jnp.float32)
                          + delta(a, b, scale, stacked=True)).astype(w.dtype)
    return pure


def full_trained(adapters) -> dict:
    """The modules of a trained tree that are trained whole (``final_norm``, ``embed``,
    ``lm_head``; :meth:`LoraSpec.full_modules`) as pure dicts / arrays, by top-level name."""
    pure = _pure(adapters)
    return {k: v for k, v in pure.items() if k in ("final_norm", "embed", "lm_head")}


def in_adapter(path) -> bool:
    """Whether a tree path (``jax.tree_util`` keys) lies inside a LoRA adapter module (a
    ``*_lora`` attribute, e.g. ``q_lora``) rather than on a model parameter."""
    return any(str(getattr(k, "key", k)).endswith("_lora") for k in path)


def zeros_like_adapters(adapters):
    """The trained tree of the base model: every adapter entry 0 (the adapter term switched
    off); a trained final norm keeps its (initial) values."""
    def one(path, x):
        return jnp.zeros_like(x) if in_adapter(path) else x.copy()
    return jax.tree_util.tree_map_with_path(one, adapters)


def tree_bytes(tree) -> int:
    """Total bytes of a tree's arrays."""
    return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape)
                   for x in jax.tree.leaves(tree)))


ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
             "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "attention_bias")


def base_config_hash(decoder_cfg) -> str:
    """SHA-256 of the base's architecture: the :data:`ARCH_KEYS` of
    ``DecoderConfig.to_hf_dict`` as sorted JSON (not dtypes or token ids)."""
    d = decoder_cfg.to_hf_dict()
    arch = json.dumps({k: d.get(k) for k in ARCH_KEYS}, sort_keys=True, default=str)
    return hashlib.sha256(arch.encode()).hexdigest()


def base_reference(model_cfg, decoder_cfg) -> dict:
    """What a LoRA checkpoint records of its frozen base: the HF folder (``model.path``; ""
    for a random base), its ``init_seed`` when random, and :func:`base_config_hash`."""
    ref = {"path": model_cfg.path, "config_sha256": base_config_hash(decoder_cfg),
           "param_dtype": model_cfg.param_dtype}
    if not model_cfg.path:
        ref["init_seed"] = int(model_cfg.init_seed)
    return ref
