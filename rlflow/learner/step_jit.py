"""The train step's ``jax.jit`` and ahead-of-time compile (MaxText's pattern: explicit
shardings, donated state, one executable per batch shape).

:func:`jit_train_step` wraps a step of :func:`rlflow.learner.step.make_train_step` with the
state's shardings (:func:`rlflow.learner.step.state_shardings`), the batch sharding
(:func:`rlflow.mesh.batch_sharding`) and replicated metrics; it takes the state split into
its params and the rest (:func:`step_args`), so that the params can be kept while the rest is
donated. :func:`compile_train_step` compiles it for one batch shape (:func:`abstract_args` of
:func:`abstract_batch`) and logs the compiled memory analysis.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from rlflow.learner.batch import TrainBatch
from rlflow.learner.step import TrainState
from rlflow.mesh import batch_sharding, replicated

logger = logging.getLogger("rlflow.learner")


def jit_train_step(step_fn, state_sh: TrainState, mesh, *, with_ref: bool, frozen_sh=None,
                   keep_params: bool = False):
    """``jax.jit`` of ``step_fn`` with explicit shardings and the state donated, called with
    :func:`step_args` (the state split into ``params`` and the rest).

    ``frozen_sh``: shardings of the ``frozen`` argument (LoRA base; never donated).
    ``keep_params``: donate the state except ``params``: every step writes its new params into
    new buffers and never writes or frees the old ones, so the arrays of a published version
    stay valid for as long as something holds them (a weight server sends them as they are,
    with no copy: :class:`rlflow.exchange.transfer.WeightPublisher` with ``donated=False``).
    Costs one params-sized buffer more during the step, the same as a publish copy.
    """
    bsh = batch_sharding(mesh)
    batch_sh = TrainBatch(*([bsh] * len(TrainBatch._fields)))

    def split_step(params, rest: TrainState, batch, ref_params, frozen):
        return step_fn(rest._replace(params=params), batch, ref_params, frozen)

    return jax.jit(split_step,
                   in_shardings=(state_sh.params, state_sh._replace(params=None), batch_sh,
                                 state_sh.params if with_ref else None, frozen_sh),
                   out_shardings=(state_sh, replicated(mesh)),
                   donate_argnums=(1,) if keep_params else (0, 1))


def step_args(state: TrainState, batch: TrainBatch, ref_params=None, frozen=None) -> tuple:
    """The arguments of a :func:`jit_train_step` step: ``(state.params, state without its
    params, batch, ref_params, frozen)`` (the params are their own argument so that they can
    be kept while the rest of the state is donated)."""
    return state.params, state._replace(params=None), batch, ref_params, frozen


def abstract_batch(rows: int, seq: int, mesh, routing=None) -> TrainBatch:
    """``jax.ShapeDtypeStruct`` batch of ``[rows, seq]`` in the batch sharding (for AOT).

    ``routing``: ``(layers, k, dtype)`` of the batch's ``routing_ids`` ``[rows, seq, layers,
    k]`` (rollout routing replay, :attr:`rlflow.learner.trainer.Learner.routing`), or None:
    the batch has none."""
    sh = batch_sharding(mesh)
    dtypes = dict(tokens=jnp.int32, attention_mask=jnp.bool_, positions=jnp.int32,
                  targets=jnp.int32, loss_mask=jnp.bool_, behaviour_logprobs=jnp.float32,
                  advantages=jnp.float32, token_rewards=jnp.float32, segment_ids=jnp.int32,
                  prefix_ids=jnp.int32, group_ids=jnp.int32, policy_lag=jnp.int32)
    fields = {f: jax.ShapeDtypeStruct((rows, seq), dtypes[f], sharding=sh) for f in dtypes}
    if routing is not None:
        layers, k, dtype = routing
        fields["routing_ids"] = jax.ShapeDtypeStruct((rows, seq, layers, k), dtype, sharding=sh)
    return TrainBatch(**fields)


def abstract_args(state: TrainState, batch: TrainBatch, ref_params=None, frozen=None) -> tuple:
    """:func:`step_args` with ``jax.ShapeDtypeStruct`` leaves (shape, dtype, sharding): what
    an AOT compile needs, and safe to keep after the state's buffers are donated."""
    def abstract(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(abstract, step_args(state, batch, ref_params, frozen))


def compile_train_step(jitted, args: tuple):
    """AOT ``lower().compile()`` of a :func:`jit_train_step` step for ``args``
    (:func:`abstract_args`, or concrete :func:`step_args`); logs memory use.

    Returns: the compiled executable (call it with :func:`step_args`).
    """
    batch = args[2]
    compiled = jitted.lower(*args).compile()
    mem = compiled.memory_analysis()
    if mem is not None:
        logger.info("train step [%s]: arguments %.1f MiB, outputs %.1f MiB, temporaries %.1f MiB, "
                    "aliased %.1f MiB, code %.1f MiB", "x".join(map(str, batch.tokens.shape)),
                    *(getattr(mem, f, 0) / 2 ** 20 for f in (
                        "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                        "alias_size_in_bytes", "generated_code_size_in_bytes")))
    return compiled
