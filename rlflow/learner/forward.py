"""The learner's forward: tempered logprobs of the batch's targets, the policy entropy, and
what else the same forward gives (PPO values, MoE load-balancing loss, router agreement), as
one :class:`PolicyOutputs` whose absent parts are None.

Logprobs are those of the tempered policy ``softmax(logits / T)`` with the sampler's
temperature ``T`` (1 for greedy sampling), the distribution the behaviour logprobs came from.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from rlflow.learner import loss_positions
from rlflow.learner.batch import TrainBatch
from rlflow.models import kernels
from rlflow.models.logprobs import chunked_logprobs

ENTROPY_CHUNK = 1024   # positions per chunk of the entropy pass beside a fused logprob kernel


class PolicyOutputs(NamedTuple):
    """One learner forward (:func:`model_outputs`); the parts it did not compute are None.

    logprobs: float32 ``[B, L]`` tempered ``log pi(targets)``; 0 off the loss positions when
      the forward projects only at ``loss_slots``.
    entropy: float32 ``[B, L]`` entropy of the tempered policy (no gradient; 0 likewise).
    values: float32 ``[B, L]`` ``V(s_t)`` aligned with ``targets`` (PPO value head), or None.
    aux_loss: float32 ``[]`` the mixture-of-experts load-balancing loss of the forward
      (:func:`rlflow.models.moe.balance_loss`), or None (``moe_aux`` off).
    router_agreement: float32 ``[2]`` summed over the layers: token-layers whose own top-k
      set equals the recorded one, token-layers with a recorded choice
      (:func:`rlflow.models.moe_replay.agreement_sums`; no gradient), or None (the batch has
      no ``routing_ids``).
    """
    logprobs: jax.Array
    entropy: jax.Array
    values: jax.Array | None = None
    aux_loss: jax.Array | None = None
    router_agreement: jax.Array | None = None


def model_outputs(graphdef, params, batch: TrainBatch, temperature: float = 1.0,
                  value_graphdef=None, frozen=None, loss_slots: tuple[int, ...] | None = None,
                  attention: str = "auto", logprob_chunk: int = 0, remat: str = "none",
                  mesh=None, moe_aux: bool = False,
                  routing_replay: bool = False, logprob_impl: str = "auto") -> PolicyOutputs:
    """One forward: tempered logprobs of ``batch.targets``, entropy and values.

    Args:
      params: the policy's ``nnx.State``, or ``(policy, value head)`` with ``value_graphdef``.
      frozen: parameters merged into the model but not trained (LoRA: the base, with
        ``params`` the adapters), or None.
      loss_slots: ``(shards, capacity)`` or ``(shards, capacity, seq_shards)``: logits only
        at ``batch.loss_mask`` positions (:func:`rlflow.learner.loss_positions.loss_index`;
        the caller guarantees at most ``capacity`` per group), logprobs and entropy 0
        elsewhere; None: every position.
      attention: the decoder's attention implementation (``learner.attention``).
      logprob_chunk: positions projected to the vocabulary at a time (``learner.logprob_chunk``;
        0: all at once), :func:`rlflow.models.logprobs.chunked_logprobs`.
      remat: the layers' rematerialisation policy (:mod:`rlflow.models.layer_scan`; what a
        backward pass through this forward keeps, never the values).
      mesh: the learner's mesh, for context parallelism (a ``sequence`` axis > 1:
        :meth:`rlflow.models.decoder.Decoder.hidden_states`), or None.
      moe_aux: also compute the mixture-of-experts load-balancing loss of this forward
        (:meth:`rlflow.models.decoder.Decoder.hidden_states`; MoE models only).
      routing_replay: route the tokens of ``batch.routing_ids`` (a mixture-of-experts
        model's recorded expert ids; rollout routing replay) to those experts; without,
        they are only compared with the model's own choice.
      logprob_impl: how the logprobs are computed (:func:`logprobs_of`).

    Returns: a :class:`PolicyOutputs`: ``values`` None without a value head, ``aux_loss``
    None without ``moe_aux``, ``router_agreement`` None when ``batch`` has no
    ``routing_ids``.
    """
    policy, vparams = (params, None) if value_graphdef is None else params
    model = nnx.merge(graphdef, policy) if frozen is None else nnx.merge(graphdef, policy, frozen)
    routed = {} if batch.routing_ids is None else dict(routing_ids=batch.routing_ids,
                                                        replay_routing=routing_replay)
    out = model.hidden_states(batch.tokens, batch.positions, batch.attention_mask,
                              segment_ids=batch.segment_ids, prefix_ids=batch.prefix_ids,
                              attention_impl=attention, remat=remat, mesh=mesh,
                              moe_aux=moe_aux, **routed)
    hidden = out.hidden
    agreement = (None if out.router_agreement is None else      # summed over the layers
                 jax.lax.stop_gradient(jnp.sum(out.router_agreement, axis=0)))
    values = None if value_graphdef is None else nnx.merge(value_graphdef, vparams)(hidden)
    if loss_slots is None:
        logp, ent = logprobs_of(model, hidden, batch.targets, temperature, logprob_chunk,
                                impl=logprob_impl)
        return PolicyOutputs(logp, ent, values, out.aux_loss, agreement)
    shards, capacity, seq_shards = (tuple(loss_slots) + (1,))[:3]
    index = loss_positions.loss_index(batch.loss_mask, shards, capacity, seq_shards)
    hidden = loss_positions.gather(hidden, index, seq_shards)
    targets = loss_positions.gather(batch.targets, index, seq_shards)
    # one chunk of every group at a time: the groups are the devices' own loss positions
    logp, ent = logprobs_of(model, hidden, targets, temperature, logprob_chunk,
                            groups=index.shape[0], impl=logprob_impl)
    shape = batch.loss_mask.shape
    return PolicyOutputs(loss_positions.scatter(logp, index, shape, seq_shards),
                         loss_positions.scatter(ent, index, shape, seq_shards), values,
                         out.aux_loss, agreement)


def logprobs_of(model, hidden: jax.Array, targets: jax.Array, temperature, chunk: int,
                groups: int = 1, impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """Tempered logprobs of ``targets`` and the policy entropy from final-normed ``hidden``
    states ``[..., E]`` (``targets`` ``[...]`` int32): float32 ``[...]`` each, the entropy
    without gradient.

    ``impl`` (:func:`rlflow.models.kernels.resolve_logprobs`; "auto": tokamax's fused
    linear + softmax kernel on TPU, the jnp path elsewhere): "jnp" is
    :func:`rlflow.models.logprobs.chunked_logprobs` (``chunk`` positions of each of
    ``groups`` spans at a time); a tokamax implementation computes the logprobs by
    :func:`rlflow.models.kernels.linear_logprobs` (no ``[N, vocab]`` logits, forward or
    backward) and the entropy, a metric without gradient, by a chunked forward-only pass
    (``chunk`` or :data:`ENTROPY_CHUNK` positions at a time).
    """
    impl = kernels.resolve_logprobs(impl)
    if impl == "jnp":
        return chunked_logprobs(model.project, hidden, targets, temperature, chunk, groups)
    logp = kernels.linear_logprobs(hidden.reshape(-1, hidden.shape[-1]), model.lm_head_kernel(),
                                   targets.reshape(-1), temperature, impl=impl)
    _, ent = chunked_logprobs(model.project, jax.lax.stop_gradient(hidden), targets,
                              temperature, chunk or ENTROPY_CHUNK, groups)
    return logp.reshape(targets.shape), ent


def policy_logprobs(graphdef, params, batch: TrainBatch, temperature: float = 1.0, frozen=None,
                    loss_slots: tuple[int, ...] | None = None, attention: str = "auto",
                    logprob_chunk: int = 0, mesh=None, routing_replay: bool = False):
    """Tempered logprobs of ``batch.targets`` and the policy entropy at each position
    (``loss_slots``, ``attention``, ``logprob_chunk``, ``mesh``, ``routing_replay``: as
    :func:`model_outputs`).

    Returns: ``(logprobs, entropy)``, both float32 ``[B, L]`` (entropy carries no gradient).
    """
    out = model_outputs(graphdef, params, batch, temperature, frozen=frozen,
                        loss_slots=loss_slots, attention=attention,
                        logprob_chunk=logprob_chunk, mesh=mesh, routing_replay=routing_replay)
    return out.logprobs, out.entropy

