"""A decoder checkpointed on one mesh and restored onto another (test helper)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlflow.checkpoint import Checkpointer, LearnerCheckpoint, abstract_target
from rlflow.mesh import param_shardings
from rlflow.models.decoder import positions_from_mask
from rlflow.models.hf import build_model
from tolerances import forward_atol


def restore_on_another_mesh(tmp_path, model_cfg, mesh_a, mesh_b):
    """Build ``model_cfg``'s random decoder on ``mesh_a``, save its parameters with orbax
    (:class:`rlflow.checkpoint.Checkpointer`) into ``tmp_path`` and restore them onto
    ``mesh_b``'s shardings (``rlflow.mesh.param_shardings``).

    Returns: ``(params_a, params_b, logits, ref, atol)``: the saved and restored
    ``nnx.State`` s, ``logits(params)`` the jitted forward of 2 rows of 6 tokens (row 0
    left-padded) as ``[2, 6, V]``, ``ref`` its value on ``params_a`` and ``atol`` the float32
    bound between two programs' logits at that scale (:func:`tolerances.forward_atol`)."""
    model, _ = build_model(model_cfg, mesh=mesh_a)
    graphdef, params_a = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, model_cfg.vocab_size, (2, 6)), jnp.int32)
    mask = jnp.ones((2, 6), bool).at[0, :2].set(False)          # left padding on row 0

    @jax.jit
    def logits(params):
        return nnx.merge(graphdef, params)(tokens, positions_from_mask(mask), mask)

    ref = np.asarray(logits(params_a))
    with Checkpointer(str(tmp_path)) as ck:
        ck.save_final(LearnerCheckpoint(step=1, params=params_a))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_a)
    target = abstract_target(abstract, param_shardings(abstract, mesh_b))
    with Checkpointer(str(tmp_path)) as ck:
        params_b = ck.restore(params_target=target).params
    return params_a, params_b, logits, ref, forward_atol(model_cfg, 6, float(np.abs(ref).max()))
