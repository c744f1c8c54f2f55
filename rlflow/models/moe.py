"""Mixture-of-experts feed-forward layer (Qwen3-MoE): top-k router, SwiGLU experts, dropless
token dispatch with a grouped matmul, and the load-balancing auxiliary loss.

Math (HF ``Qwen3MoeSparseMoeBlock``, transformers 5.x; Shazeer et al. 2017, "Outrageously
Large Neural Networks", eq. 3-5 for softmax top-k gating): for a token ``x [E]``,

* router logits ``z = x @ W_r`` ``[n]`` and probabilities ``p = softmax(z)`` in float32;
* the ``k`` experts of largest ``p`` (ids ``i_1..i_k``), gates ``g_j = p_{i_j}``, divided by
  ``sum_j g_j`` when ``norm_topk_prob``;
* output ``y = sum_j g_j * down_{i_j}(silu(x @ gate_{i_j}) * (x @ up_{i_j}))`` (SwiGLU,
  Shazeer 2020, eq. 6, per expert).

Dispatch is dropless (no capacity factor, no token dropped; Gale et al. 2023, "MegaBlocks"):
the ``N x k`` (token, expert) pairs are sorted by expert and each expert's contiguous rows
are multiplied by its weights with one grouped matmul (group sizes = tokens per expert;
:func:`rlflow.models.kernels.ragged_dot`: tokamax's kernel on TPU / GPU, ``jax.lax.ragged_dot``
on CPU); the results are unsorted and summed per token weighted by the gates. On a mesh with
an ``expert`` axis the experts are split over it and the tokens reach them by
:func:`rlflow.models.expert_parallel.expert_ffn`.

gpt-oss (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card"; HF ``GptOssMLP``): the
router has a bias, ``z = x @ W_r + b_r`` (its softmax over the top-k logits equals the
top-k probabilities renormalised, ``norm_topk_prob``); each expert's projections have biases
and the clamped SwiGLU ``(clip(u, -l, l) + 1) * g' * sigmoid(alpha g')`` with
``g' = min(g, l)`` (``alpha = swiglu_alpha``, ``l = swiglu_limit``).

Rollout routing replay (R3: Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by
Aligning Training and Inference Routers", arXiv 2510.11370, Sec. 3): given the expert ids
the sampler chose, the layer uses those ids instead of its own top-k, with the gates still
computed from *this* router's probabilities at those ids (renormalised the same way), so
the router keeps its gradient.

Load balancing (Fedus et al. 2021, "Switch Transformers", eq. 4-6; HF
``load_balancing_loss_func``): ``aux = n * sum_e f_e * P_e`` with ``f_e`` the fraction of
(token, top-k slot) assignments routed to expert ``e`` and ``P_e`` the mean router
probability of ``e``, both over the valid tokens of every MoE layer together.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from rlflow.models.expert_parallel import context_mesh, expert_ffn, expert_size
from rlflow.models.kernels import ragged_dot
from rlflow.models.linear import _dense, _normal, _param     # one matmul and init for every kernel

EXPERT_AXES = ("expert", "embed", "mlp")        # gate / up kernels [n, E, F]
EXPERT_DOWN_AXES = ("expert", "mlp", "embed")   # down kernel [n, F, E]
ROUTER_AXES = ("embed", None)                   # router [E, n]


class Routing(NamedTuple):
    """One MoE layer's routing of ``N`` tokens.

    expert_ids: ``[N, k]`` int32, the experts each token went to (top-k order, or the
      replayed ids).
    gates: ``[N, k]`` float32 combine weights of those experts.
    probs: ``[N, n]`` float32 router probabilities ``softmax(z)`` (the load-balancing loss's
      ``P``).
    """
    expert_ids: jax.Array
    gates: jax.Array
    probs: jax.Array


def route(router_logits: jax.Array, k: int, norm_topk_prob: bool,
          replay_ids: jax.Array | None = None) -> Routing:
    """Softmax top-k routing (module doc), as HF ``Qwen3MoeTopKRouter``.

    Args:
      router_logits: ``[N, n]`` router logits (any float dtype; softmax in float32).
      k: experts per token (``num_experts_per_tok``), ``1 <= k <= n``.
      norm_topk_prob: divide the ``k`` gates by their sum.
      replay_ids: ``[N, k]`` int expert ids to use instead of this router's top-k (rollout
        routing replay); a token whose ids are -1 (no recorded choice,
        :data:`rlflow.exchange.routing.NO_CHOICE`) takes this router's top-k; None: this
        router's top-k for every token.

    Returns:
      :class:`Routing`; ``expert_ids`` are ``replay_ids`` (as int32) when given, this
      router's top-k on tokens without a recorded choice.

    Raises:
      ValueError: ``replay_ids`` is not ``[N, k]``.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    if replay_ids is None:
        gates, ids = jax.lax.top_k(probs, k)
    else:
        if replay_ids.shape != probs.shape[:-1] + (k,):
            raise ValueError(f"replay_ids must be [tokens, k] = {list(probs.shape[:-1]) + [k]}, "
                             f"got {list(replay_ids.shape)}")
        own = jax.lax.top_k(probs, k)[1]
        recorded = jnp.all(replay_ids >= 0, axis=-1, keepdims=True)
        ids = jnp.where(recorded, replay_ids.astype(jnp.int32), own)
        gates = jnp.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return Routing(ids.astype(jnp.int32), gates, probs)


class ExpertBiases(NamedTuple):
    """gpt-oss's expert extras: ``gate`` / ``up`` ``[n, F]`` and ``down`` ``[n, E]`` biases
    (compute dtype) and the clamped SwiGLU's ``alpha`` and ``limit`` (module doc)."""
    gate: jax.Array
    up: jax.Array
    down: jax.Array
    alpha: float
    limit: float


def _expert_bias(bias: jax.Array, sorted_ids: jax.Array) -> jax.Array:
    """Rows of ``bias [n, X]`` for the sorted pairs' experts (0 for pairs not here)."""
    n = bias.shape[0]
    return jnp.where((sorted_ids < n)[:, None], jnp.take(bias, jnp.minimum(sorted_ids, n - 1),
                                                         axis=0), 0)


def dispatch(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, gate_kernel: jax.Array,
             up_kernel: jax.Array, down_kernel: jax.Array, first_expert=0,
             biases: ExpertBiases | None = None, *, impl: str = "auto") -> jax.Array:
    """Dropless expert computation (module doc): every (token, expert) pair is computed.

    Args:
      x: ``[N, E]`` tokens (compute dtype).
      expert_ids: ``[N, k]`` int32 in ``[0, n)``.
      gates: ``[N, k]`` combine weights (cast to ``x.dtype`` before the combine, as HF).
      gate_kernel / up_kernel: ``[n_here, E, F]``; down_kernel: ``[n_here, F, E]``
        (``x.dtype``): the experts ``first_expert .. first_expert + n_here - 1`` (all ``n``
        with the default 0; one device's share under expert parallelism,
        :mod:`rlflow.models.expert_parallel`).
      first_expert: global id of the kernels' expert 0 (int or int32 scalar). Pairs whose
        expert is not among these sort after the last group, get no product, and add 0.
      biases: gpt-oss's :class:`ExpertBiases` of these experts, or None (SwiGLU, no biases).
      impl: the grouped matmul (:func:`rlflow.models.kernels.resolve_ragged_dot`; "auto":
        tokamax on TPU / GPU, ``jax.lax.ragged_dot`` on CPU).

    Returns:
      ``[N, E]`` in ``x.dtype``: ``sum_j gates[:, j] * expert_{ids[:, j]}(x)`` over the
      pairs whose expert is here.
    """
    n_tokens, k = expert_ids.shape
    n_experts = gate_kernel.shape[0]
    local = expert_ids.reshape(-1).astype(jnp.int32) - jnp.asarray(first_expert, jnp.int32)
    here = (local >= 0) & (local < n_experts)                       # [N k]
    flat = jnp.where(here, local, n_experts)                        # others: after the last
    order = jnp.argsort(flat, stable=True)                          # pairs sorted by expert
    rows = jnp.take(x, order // k, axis=0)                          # [N k, E]
    sizes = jnp.bincount(flat, length=n_experts + 1)[:n_experts].astype(jnp.int32)  # [n]
    g = ragged_dot(rows, gate_kernel, sizes, impl=impl)
    u = ragged_dot(rows, up_kernel, sizes, impl=impl)               # [N k, F]
    if biases is None:
        h = jax.nn.silu(g) * u
    else:
        ids = jnp.take(flat, order)                                 # sorted pairs' experts
        g = jnp.minimum(g + _expert_bias(biases.gate, ids), biases.limit)
        u = jnp.clip(u + _expert_bias(biases.up, ids), -biases.limit, biases.limit)
        h = (u + 1) * (g * jax.nn.sigmoid(g * biases.alpha))
    out = ragged_dot(h, down_kernel, sizes, impl=impl)              # [N k, E]
    if biases is not None:
        out = out + _expert_bias(biases.down, ids)
    out = jnp.take(out, jnp.argsort(order), axis=0)
    out = jnp.where(here[:, None], out, 0).reshape(n_tokens, k, -1)
    return jnp.einsum("nk,nke->ne", gates.astype(x.dtype), out)


class MoE(nnx.Module):
    """Qwen3-MoE feed-forward layer (module doc): ``router [E, n]``, expert kernels
    ``gate_kernel``, ``up_kernel`` ``[n, E, F]`` and ``down_kernel`` ``[n, F, E]`` (logical
    axes :data:`EXPERT_AXES`, :data:`EXPERT_DOWN_AXES`), ``F = moe_intermediate_size``.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs, lora=None):
        if lora is not None and any(lora.targets(p) for p in ("gate", "up", "down")):
            raise ValueError("learner.lora.targets: LoRA on the MLP projections (gate_proj, "
                             "up_proj, down_proj) of a mixture-of-experts model is not "
                             "supported; target the attention projections only, e.g. "
                             "targets=('q_proj', 'k_proj', 'v_proj', 'o_proj')")
        e, f, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        pdt, self.dtype = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
        self.k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = _normal(rngs, (e, n), pdt, ROUTER_AXES)
        self.gate_kernel = _normal(rngs, (n, e, f), pdt, EXPERT_AXES)
        self.up_kernel = _normal(rngs, (n, e, f), pdt, EXPERT_AXES)
        self.down_kernel = _normal(rngs, (n, f, e), pdt, EXPERT_DOWN_AXES)
        self.swiglu = (cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.expert_biases else None
        if cfg.expert_biases:               # gpt-oss (module doc)
            zeros = lambda shape, axes: _param(jnp.zeros(shape, pdt), axes)  # noqa: E731
            self.router_bias = zeros((n,), (None,))
            self.gate_bias = zeros((n, f), ("expert", "mlp"))
            self.up_bias = zeros((n, f), ("expert", "mlp"))
            self.down_bias = zeros((n, e), ("expert", "embed"))
        else:
            self.router_bias = self.gate_bias = self.up_bias = self.down_bias = None
        fs = cfg.shared_expert_intermediate_size       # Qwen3.5-MoE's shared expert
        if fs:
            self.shared_gate_kernel = _normal(rngs, (e, fs), pdt, ("embed", "mlp"))
            self.shared_up_kernel = _normal(rngs, (e, fs), pdt, ("embed", "mlp"))
            self.shared_down_kernel = _normal(rngs, (fs, e), pdt, ("mlp", "embed"))
            self.shared_expert_gate = _normal(rngs, (e, 1), pdt, ("embed", None))
        else:
            self.shared_gate_kernel = self.shared_up_kernel = None
            self.shared_down_kernel = self.shared_expert_gate = None

    def __call__(self, x: jax.Array, replay_ids: jax.Array | None = None
                 ) -> tuple[jax.Array, Routing]:
        """``x [..., E]`` -> ``(y [..., E], routing)``; ``routing``'s arrays are flat over the
        leading axes (``N = prod(x.shape[:-1])``). ``replay_ids``: ``[..., k]`` int expert ids
        to replay (:func:`route`), or None."""
        lead, e = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, e)
        logits = _dense(flat, self.router[...].astype(self.dtype),
                        preferred_element_type=jnp.float32)
        if self.router_bias is not None:
            logits = logits + self.router_bias[...].astype(self.dtype).astype(jnp.float32)
        replay = None if replay_ids is None else replay_ids.reshape(-1, self.k)
        routing = route(logits, self.k, self.norm_topk_prob, replay)
        experts_fn, mesh = dispatch, context_mesh()
        if self.swiglu is not None:
            if expert_size(mesh) > 1:
                raise ValueError("mesh.expert > 1 (expert parallelism) does not run gpt-oss's "
                                 "expert biases yet; set mesh.expert=1")
            biases = ExpertBiases(*(b[...].astype(self.dtype) for b in
                                    (self.gate_bias, self.up_bias, self.down_bias)),
                                  *self.swiglu)
            experts_fn = functools.partial(dispatch, biases=biases)
        y = expert_ffn(flat, routing.expert_ids, routing.gates,
                       self.gate_kernel[...].astype(self.dtype),
                       self.up_kernel[...].astype(self.dtype),
                       self.down_kernel[...].astype(self.dtype), mesh=mesh,
                       experts_fn=experts_fn)
        if self.shared_gate_kernel is not None:
            y = y + self._shared(flat)
        return y.reshape(*lead, e), routing

    def _shared(self, flat):
        """Qwen3.5-MoE's shared expert ``sigmoid(x g) * down(silu(x W_gate) * (x W_up))``
        (transformers' ``Qwen3_5MoeSparseMoeBlock``); ``flat [N, E]``."""
        w = lambda p: p[...].astype(self.dtype)   # noqa: E731
        h = jax.nn.silu(_dense(flat, w(self.shared_gate_kernel))) * _dense(
            flat, w(self.shared_up_kernel))
        return jax.nn.sigmoid(_dense(flat, w(self.shared_expert_gate))) * _dense(
            h, w(self.shared_down_kernel))


# ------------------------------------------------------------------ load-balancing loss
def balance_sums(routing: Routing, weights: jax.Array) -> jax.Array:
    """One layer's terms of the load-balancing loss: ``[2, n]`` float32, row 0 the
    (weighted) count of top-k assignments per expert, row 1 the (weighted) sum of router
    probabilities per expert.

    Args:
      routing: the layer's :class:`Routing` of ``N`` tokens.
      weights: ``[N]`` token weights (1 for a real token, 0 for padding).
    """
    w = weights.astype(jnp.float32).reshape(-1)
    n = routing.probs.shape[-1]
    counts = jnp.zeros((n,), jnp.float32).at[routing.expert_ids].add(
        jnp.broadcast_to(w[:, None], routing.expert_ids.shape))
    return jnp.stack([counts, jnp.sum(routing.probs * w[:, None], axis=0)])


def balance_loss(sums: jax.Array, tokens: jax.Array) -> jax.Array:
    """The load-balancing loss ``n * sum_e f_e P_e`` (module doc) from the sums of
    :func:`balance_sums` over the layers.

    Args:
      sums: ``[2, n]`` float32, :func:`balance_sums` summed over the MoE layers.
      tokens: float32 ``[]``, the number of (weighted) token rows summed, layers times
        valid tokens (0 gives 0).

    Returns:
      float32 ``[]``; 1 for perfectly balanced routing with ``k = 1`` (``k`` with top-k).
    """
    n = sums.shape[-1]
    denom = jnp.maximum(tokens, 1.0)
    return n * jnp.sum((sums[0] / denom) * (sums[1] / denom))
