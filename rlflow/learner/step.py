"""The jitted, sharded train step: ``(state, batch, ref_params, frozen) -> (state, metrics)``.

One optimiser step per batch: the loss and its gradient accumulated over micro-batches
(:mod:`rlflow.learner.grad`), from the learner's forward (:mod:`rlflow.learner.forward`:
logprobs of the tempered policy ``softmax(logits / T)`` with the sampler's temperature ``T``),
under the static :class:`StepSettings` (:mod:`rlflow.learner.step_settings`); the metrics come
from the accumulated sums, one group per feature (:mod:`rlflow.learner.step_sums`).

PPO (``settings.gae``): a :class:`rlflow.learner.value.ValueHead` on the same forward gives
``V(s_t)`` (GAE targets: :mod:`rlflow.learner.grad`). The trainable tree is the pair ``(policy
params, value-head params)`` (:func:`trainable`): one optimiser, joint gradient clipping; the
head lives in ``TrainState.value``, never in ``TrainState.params``.

Layout: parameters and the optimiser state use :func:`rlflow.mesh.param_shardings` (FSDP x
tensor), the batch :func:`rlflow.mesh.batch_sharding`, metrics are replicated. The jit with
those shardings and the donated state, and the ahead-of-time compile, are
:mod:`rlflow.learner.step_jit`'s.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rlflow.learner import step_sums
from rlflow.learner.batch import TrainBatch
from rlflow.learner.forward import PolicyOutputs, model_outputs, policy_logprobs
from rlflow.learner.grad import make_grad_fn, split_micro
from rlflow.learner.step_settings import StepSettings, moe_aux_coef, routing_replay
from rlflow.mesh import param_shardings, replicated

# Defined in the modules above and imported from here too (the import path callers use).
__all__ = ["PolicyOutputs", "StepSettings", "TrainState", "init_state", "make_grad_fn",
           "make_train_step", "model_outputs", "moe_aux_coef", "policy_logprobs",
           "routing_replay", "split_micro", "state_shardings", "trainable"]


class TrainState(NamedTuple):
    """Everything the optimiser step changes (donated to the step).

    step: int32 ``[]`` optimiser steps taken (= the policy version of ``params``).
    params: ``nnx.State`` of the policy's master parameters (``model.param_dtype``): what
      weight transfer publishes and export writes.
    opt_state: the optax state (AdamW moments shaped like ``params``, or like the pair
      ``(params, value)`` with a value head).
    value: ``nnx.State`` of the PPO value head (float32), or None (group estimators).
    """
    step: jax.Array
    params: Any
    opt_state: Any
    value: Any = None



def trainable(params, value=None):
    """The tree the optimiser updates: ``params``, or ``(params, value)`` with a value head."""
    return params if value is None else (params, value)


def init_state(params, tx: optax.GradientTransformation, mesh=None, value=None) -> TrainState:
    """A fresh :class:`TrainState` (step 0) laid out in :func:`state_shardings` when ``mesh``;
    ``value``: the value head's params (PPO) or None."""
    def make(p, v):
        return TrainState(jnp.zeros((), jnp.int32), p, tx.init(trainable(p, v)), v)

    if mesh is None:
        return make(params, value)
    return jax.jit(make, out_shardings=state_shardings(params, tx, mesh, value))(params, value)


def state_shardings(params, tx: optax.GradientTransformation, mesh, value=None) -> TrainState:
    """Shardings of the state: params (and value head) per the logical-axis rules, the
    optimiser's param-shaped entries (moments) like their params, everything else replicated."""
    ps = param_shardings(params, mesh)
    vs = None if value is None else param_shardings(value, mesh)
    abstract = jax.eval_shape(tx.init, trainable(params, value))
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    opt = optax.tree_map_params(tx, lambda _, s: s, abstract, trainable(ps, vs),
                                transform_non_params=lambda _: replicated(mesh), is_leaf=is_var)
    return TrainState(replicated(mesh), ps, opt, vs)



def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    settings: StepSettings, mesh=None, value_graphdef=None):
    """The pure train step ``(state, batch, ref_params, frozen=None) -> (state, metrics)``.

    Args:
      graphdef: the model's ``nnx.GraphDef`` (from ``nnx.split(model, nnx.Param)``).
      tx, schedule: from :func:`rlflow.learner.optimizer.make_optimizer`.
      settings: :class:`StepSettings`.
      mesh: when given, micro-batches are constrained to :func:`rlflow.mesh.batch_sharding`.
      value_graphdef: the value head's graphdef with ``settings.gae`` (``state.value`` holds
        its params), else None.

    The step's ``batch`` is a :class:`TrainBatch` of ``[B, L]`` arrays with ``B`` divisible by
    ``settings.micro_batches``; ``ref_params`` are the frozen reference parameters (or None:
    no KL term). ``frozen``: parameters of the model outside the train state, never updated
    (LoRA: the base model; ``state.params`` are then the adapters).

    Metrics (float32 scalars): ``learner/loss``, ``learner/grad_norm`` (before clipping; with
    a value head the joint norm of policy and value-head gradients), ``learner/tokens``,
    ``learner/lr``, ``learner/kept_tokens`` (loss tokens with a non-zero policy-loss weight:
    not rejected by the rollout correction), ``learner/skipped`` (1 when
    ``learner/kept_tokens`` is 0, i.e. no loss token or every one rejected: parameters,
    optimiser state and step are then left unchanged, bit for bit; the KL and value terms of
    such a step are not applied either); then one group per feature
    (:mod:`rlflow.learner.step_sums`): the policy's
    (:func:`~rlflow.learner.step_sums.policy_metrics`: ``learner/pg_loss``, ``policy/*``), the
    mismatch diagnostics and rollout correction's for the batch and per policy-lag bucket
    (:func:`~rlflow.learner.step_sums.mismatch_metrics`),
    PPO's (``settings.gae``: :func:`~rlflow.learner.step_sums.value_metrics`), and a
    mixture-of-experts model's (:func:`~rlflow.learner.step_sums.moe_metrics`:
    ``moe/aux_loss`` with ``settings.moe_aux``, ``learner/loss`` then holding it times
    ``settings.moe_aux_coef``; ``moe/router_agreement`` and ``moe/logprob_gap`` for batches
    with ``routing_ids``, with or without ``settings.routing_replay``).
    """
    grad_fn = make_grad_fn(graphdef, settings, mesh, value_graphdef)

    def step(state: TrainState, batch: TrainBatch, ref_params, frozen=None):
        current = trainable(state.params, state.value)
        loss, grads, acc = grad_fn(current, batch, ref_params, frozen)
        grad_norm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, current)
        new = optax.apply_updates(current, updates)
        n_tok = jnp.sum(batch.loss_mask).astype(jnp.float32)
        # a batch whose every token has policy-loss weight 0 (no loss token, or every one
        # rejected by the rollout correction) carries no signal: an AdamW update on it would
        # still move every parameter by about lr (the first moment, weight decay), so keep
        # params, moments and version (verl PR #3915, NeMo-RL PR #4001 fixed the same)
        skip = acc["effective"] == 0
        new, opt_state = jax.tree.map(lambda old, new: jnp.where(skip, old, new),
                                      (current, state.opt_state), (new, opt_state))
        params, value = (new, None) if state.value is None else new
        metrics = {
            "learner/loss": loss,
            "learner/grad_norm": grad_norm,
            "learner/tokens": n_tok,
            "learner/kept_tokens": acc["effective"],
            "learner/lr": jnp.asarray(schedule(state.step), jnp.float32),
            "learner/skipped": skip.astype(jnp.float32),
        }
        metrics |= step_sums.policy_metrics(acc, n_tok)
        metrics |= step_sums.mismatch_metrics(acc)
        if settings.gae:
            metrics |= step_sums.value_metrics(acc, n_tok)
        # routed: a mixture-of-experts model's batch (with routing_ids)
        metrics |= step_sums.moe_metrics(acc, n_tok, aux=settings.moe_aux,
                                         routed=batch.routing_ids is not None)
        return TrainState(state.step + 1 - skip.astype(jnp.int32), params, opt_state,
                          value), metrics

    return step
