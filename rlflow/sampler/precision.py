"""The sampler's own dtype beside the learner's (``sampler.dtype``).

A bf16 sampler beside a float32 learner: the engine is built from the model section with
both dtypes set to ``sampler.dtype`` (:func:`sampler_model_config`), the learner publishes
each version already rounded to bf16 (``ExperimentConfig.published_dtype``,
:func:`rlflow.learner.publish.published_params`), weight pulls land in that dtype
(:func:`pull_target`), and the engine casts to its own dtype at the swap
(``RlflowEngine.load_params``; a no-op for bf16 versions in a bf16 engine, exact widening
for a float32 engine).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rlflow.models.lora import in_adapter


def sampler_model_config(cfg):
    """The model section the sampler builds its engine from: ``cfg.model`` with both dtypes
    set to ``sampler.dtype`` when that is set (else ``cfg.model`` itself)."""
    dtype = cfg.sampler.dtype
    if dtype is None or (cfg.model.dtype, cfg.model.param_dtype) == (dtype, dtype):
        return cfg.model
    return dataclasses.replace(cfg.model, dtype=dtype, param_dtype=dtype)


def pull_target(state, learner_dtype: str):
    """What a weight pull lands in: ``state``'s shapes and shardings with the dtypes the
    learner publishes, as ``jax.ShapeDtypeStruct`` leaves (never ``state``'s arrays: the
    subscriber keeps its target for the whole run, and a target of arrays kept the weights
    the sampler loaded at start-up resident beside every pulled version, 0.5 GiB for
    SmolLM2-135M in float32). Model leaves carry ``learner_dtype``
    (``cfg.published_dtype``); where the engine's dtype differs the engine casts each
    version at the swap (``RlflowEngine.load_params``). LoRA adapter leaves (inside
    ``*_lora`` modules) are float32 on both sides and keep their dtype; with LoRA,
    ``state`` is the adapter tree, whose modules trained whole (``embed``,
    ``final_norm``, ``lm_head``) are model leaves."""
    want = np.dtype(jax.numpy.dtype(learner_dtype))

    def one(path, x):
        dtype = x.dtype if in_adapter(path) else want
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=getattr(x, "sharding", None))

    return jax.tree_util.tree_map_with_path(one, state)
