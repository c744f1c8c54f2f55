"""A LoRA decoder built from a base decoder: the adapters added to a built model, and the
adapter tree of a config as shapes (a transfer / restore target).

The adapter term itself (``W + (alpha / rank) A B``, Hu et al. 2021) and its trees live in
:mod:`rlflow.models.lora`; this module builds :class:`rlflow.models.decoder.Decoder` with it.
"""

from __future__ import annotations

import jax
from flax import nnx

from rlflow.models.decoder import Decoder
from rlflow.models.lora import LoraSpec, split_lora


def lora_model_parts(model, decoder_cfg, spec: LoraSpec, *, seed: int = 0, mesh=None):
    """Add adapters to a built (base) decoder.

    Args:
      model: the base :class:`rlflow.models.decoder.Decoder` (e.g. from
        :func:`rlflow.models.hf.build_model`); its parameters become the frozen base.
      decoder_cfg: its :class:`DecoderConfig`.
      spec: :class:`LoraSpec`.
      seed: PRNG seed of the adapters' ``A`` init.
      mesh: when given, the adapters are created in their shardings.

    Returns: ``(graphdef, adapters, base)``: the LoRA decoder's graphdef (``nnx.merge(graphdef,
    adapters, base)`` builds it), its adapters (``nnx.State`` of ``nnx.LoRAParam``, ``B = 0``)
    and the base parameters (the very arrays of ``model``, not a copy).

    Raises: ValueError when the base parameters do not fit the LoRA decoder's tree.
    """
    def init():
        return Decoder(decoder_cfg, rngs=nnx.Rngs(params=seed), lora=spec)

    graphdef, abs_adapters, abs_base = split_lora(nnx.eval_shape(init), spec)
    _, norm, base = nnx.split(model, spec.trainable(), nnx.Param)
    if jax.tree.structure(base) != jax.tree.structure(abs_base):
        raise ValueError("lora_model_parts: the base model's parameters do not match the LoRA "
                         "decoder's base tree")
    make = lambda: nnx.state(init(), nnx.LoRAParam)  # noqa: E731 (XLA drops the base init)
    if mesh is None:
        adapters = jax.jit(make)()
    else:
        from rlflow.mesh import param_shardings
        lora_only = nnx.state(nnx.eval_shape(init), nnx.LoRAParam)
        adapters = jax.jit(make, out_shardings=param_shardings(lora_only, mesh))()
    if spec.full_modules():              # trained whole: start at the base's own values
        adapters = nnx.merge_state(adapters, jax.tree.map(lambda x: x.copy(), norm))
    if jax.tree.structure(adapters) != jax.tree.structure(abs_adapters):
        raise ValueError("lora_model_parts: the trained tree does not match the LoRA decoder's")
    return graphdef, adapters, base


def abstract_adapters(decoder_cfg, spec: LoraSpec):
    """The adapter tree of ``decoder_cfg`` + ``spec`` as ``ShapeDtypeStruct`` leaves (an
    ``nnx.State`` with the logical-axis metadata; a weight-transfer / restore target)."""
    abstract = nnx.eval_shape(lambda: Decoder(decoder_cfg, rngs=nnx.Rngs(0), lora=spec))
    return nnx.state(abstract, spec.trainable())
