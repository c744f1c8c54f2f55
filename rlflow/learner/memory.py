"""Learner memory per chip, computed from the architecture and the config (before any run).

What one chip of the learner mesh holds during a train step (bytes):

* parameters: ``N x param bytes / (fsdp x tensor)`` (replicated over ``data`` and
  ``sequence``; with mixture-of-experts layers ``N`` is the parameters outside the experts
  plus the experts' ``N_x / expert``, the expert weights being split over the ``expert``
  axis and everything else replicated over it, :mod:`rlflow.models.expert_parallel`; the
  same count for every state term below);
* AdamW moments ``mu``, ``nu``: ``2 x N x param bytes / (fsdp x tensor)`` (optax keeps them in
  the parameters' dtype);
* gradients: ``N x (4 + param bytes) / (fsdp x tensor)``: the float32 accumulator over
  micro-batches and the micro-batch's own gradient being added to it (in the parameters'
  dtype); both are live through the backward pass (XLA's compiled temporaries hold two
  gradient-sized buffers also with one micro-batch, ``benchmarks/long_context.py``);
* KL reference copy (``learner.kl_coef > 0``): ``N x param bytes / (fsdp x tensor)``;
* the published version (``runtime.weight_transfer = "transfer"``): ``N x published bytes /
  (fsdp x tensor)``: in the learner's dtype the step keeps the params it was given, which
  the weight server may be sending, and writes the new ones beside them
  (``rlflow.learner.publish.keeps_params``); in a narrower sampler dtype
  (``ExperimentConfig.published_dtype``) the server holds that cast copy instead and the
  step donates its params;
* activations of one micro-batch for the backward pass, which depend on ``learner.remat``
  (:mod:`rlflow.models.layer_scan`). Per token, with ``a`` = compute dtype bytes, ``t`` =
  tensor axis, ``T`` = row length, rows per chip = micro-batch rows / (data x fsdp), and
  ``T / sequence`` positions of each row per chip (context parallelism: the ``sequence``
  axis splits every row's positions, so every per-token term below counts ``rows x T /
  sequence`` tokens), one layer's intermediates are ``A = a x (4 h + 4 i / t + 2 (q + 2 kv) d / t) + S`` bytes (norms /
  residuals, MLP gate, up, product, activation, attention projections) with the attention
  scores and probabilities ``S = 2 x 4 x (q / t) x T`` in float32 (``S = 0`` when
  ``scores_materialised=False``: a memory-efficient attention that never holds ``[T, T]``).

  - ``"none"``: every layer's intermediates are kept, ``L x A``, plus the working set of
    the layer being differentiated, ``W = A + 3 a i / t``: its intermediates' cotangents,
    of which the MLP's three ``i``-wide ones (gate, up, their product) are live at once
    at the peak;
  - ``"full"`` (and ``"offload"``, whose saved matmul outputs live in host memory): each
    layer keeps only its input, the residual carry ``[B, T, E]``: ``L x a h``, plus the
    working set of the one layer being differentiated, its recomputed intermediates ``A``
    and the MLP's cotangents: ``W = A + 3 a i / t``;
  - ``"dots"``: each layer keeps its input and its projections' outputs (q, k, v, o, gate,
    up, down): ``L x a (h + (q + 2 kv) d / t + 2 h + 2 i / t)``, plus ``W = A`` (the saved
    gate and up outputs are not recomputed).

  With ``sequence > 1`` the layer being differentiated also holds its keys and values
  all-gathered over the axis and their cotangents, ``4 x a x kv d / t`` per token of the
  whole row (:mod:`rlflow.models.context_parallel`).

  The float32 logits, log-softmax and their gradient, ``3 x 4 x V / t`` per token, for every
  token of the micro-batch, or for ``logits_chunk_tokens`` tokens when the logprobs are
  computed in chunks of that many tokens, are live only while the output layer runs, when
  no decoder layer is being differentiated: the activations are ``kept + max(W x tokens
  + gathered, logits)``, not their sum. The working-set factors were measured against XLA's
  compiled temporaries (``benchmarks/long_context.py``, remat "full": 1.53 A and 1.51 A per
  token at hidden 256 and 512, against ``A + 3 a i / t`` = 1.50 A for both).
  The scan's stacked copy of the layer parameters is not counted (XLA slices it in place).
  Checked against XLA's compiled temporaries by ``benchmarks/long_context.py``.

Mixture-of-experts layers (``num_experts > 0``): a layer's MLP intermediates ``4 i / t`` are
replaced by what the dropless expert dispatch holds per local token with ``ep`` = the
``expert`` axis and ``k`` = experts per token: the other devices' tokens all-gathered over the
axis and their partial outputs before the reduce-scatter, ``2 (ep - 1) h``, and for every one
of the ``ep k`` (token, expert) rows the sorted input and the expert output, ``2 h``, and the
gate, up, product and activation, ``4 f / t`` (``f = moe_intermediate_size``): ``a (2 (ep - 1)
h + ep k (2 h + 4 f / t))``, plus the float32 router probabilities ``4 n``; the worst case
(every gathered token routed to this device's experts), which static shapes must hold for the
dispatch to stay dropless. Their cotangents ``3 a ep k f / t``; "dots" keeps
``2 a ep k f / t`` of them. With ``ep = 1`` this is a dense MLP of width ``i = k f`` plus the
dispatch's ``2 a k h`` and the router's ``4 n``.

Layers of several kinds (``Architecture.layer_types``, :mod:`rlflow.models.layer_pattern`):
full and sliding-window attention layers count as above (the learner's forward holds the
same ``[T, T]`` scores for both when it materialises them); a gated DeltaNet layer
(``"linear_attention"``, Qwen3.5) has no scores and its own projections and chunk states
(:func:`_gdn_layer`); the working set is the larger kind's.

``N`` counts embeddings, ``L`` layers of (q, k, v, o projections, gate/up/down MLP, two RMSNorm
scales), the final norm and (untied) the output projection, Qwen2's q/k/v biases included
when ``qkv_bias`` and Qwen3's q/k norm scales when ``qk_norm``; with experts, each layer's
MLP is the router ``h n`` and ``n`` experts of ``3 h f`` (all are stored, trained and
published). The activation term is an
estimate of what XLA keeps (it may fuse some away); the state terms are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlflow.config import ConfigError

GIB = 2 ** 30
GDN_CHUNK = 64       # rlflow.models.gated_delta.DEFAULT_CHUNK (no jax imported here)
_BYTES = {"float32": 4, "bfloat16": 2}


class LearnerDoesNotFit(ConfigError):
    """The learner's state and activations exceed a chip's memory; the message names the
    mesh, each term in GiB and the chip's capacity."""


@dataclass(frozen=True)
class Architecture:
    """Sizes of a Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder (Hugging Face ``config.json``
    names in comments)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int          # num_hidden_layers
    num_heads: int           # num_attention_heads
    num_kv_heads: int        # num_key_value_heads
    head_dim: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False   # Qwen2
    qk_norm: bool = False    # Qwen3: per-head RMSNorm scales on q and k
    num_experts: int = 0     # Qwen3-MoE: experts per layer (0: a dense MLP)
    num_experts_per_tok: int = 0        # top-k
    moe_intermediate_size: int = 0      # each expert's SwiGLU width
    layer_types: tuple = ()  # each layer's kind (HF layer_types); (): all "full_attention"
    sliding_window: int = 0  # keys a "sliding_attention" query sees (Gemma 3, gpt-oss)
    gdn: dict | None = None  # "linear_attention" (gated DeltaNet) shapes: GDN_KEYS (Qwen3.5)
    attn_output_gate: bool = False      # Qwen3.5: q_proj twice as wide (query | gate)
    shared_expert_intermediate_size: int = 0   # Qwen3.5-MoE: the shared expert's width

    @classmethod
    def from_model_config(cls, m) -> "Architecture":
        """From a :class:`rlflow.config.ModelConfig` (a random model's fields)."""
        moe = m.model_type == "qwen3_moe"
        return cls(m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads,
                   m.num_kv_heads, m.head_dim, m.tie_word_embeddings, m.model_type == "qwen2",
                   m.model_type in ("qwen3", "qwen3_moe"),
                   num_experts=m.num_experts if moe else 0,
                   num_experts_per_tok=m.num_experts_per_tok if moe else 0,
                   moe_intermediate_size=m.moe_intermediate_size if moe else 0)

    @property
    def kinds(self) -> tuple:
        """The kind of each of the ``L`` layers (``"full_attention"``, ``"sliding_attention"``,
        ``"linear_attention"``; :mod:`rlflow.models.layer_pattern`)."""
        return tuple(self.layer_types) or ("full_attention",) * self.num_layers

    @property
    def attention_layers(self) -> int:
        """Layers with keys and values (full or sliding attention)."""
        return sum(1 for k in self.kinds if k != "linear_attention")

    def gdn_params(self) -> int:
        """Parameters of one gated DeltaNet layer's token mixing
        (:class:`rlflow.models.gdn_layer.GatedDeltaNet`): q, k ``[E, Hk dk]``, v, z ``[E, Hv
        dv]``, b, a ``[E, Hv]``, the convs ``K (2 Hk dk + Hv dv)``, ``A_log``, ``dt_bias``
        ``[Hv]``, the norm ``[dv]``, out ``[Hv dv, E]``; 0 without such layers."""
        if not self.gdn:
            return 0
        g, h = self.gdn, self.hidden_size
        key, value = g["num_k_heads"] * g["head_k_dim"], g["num_v_heads"] * g["head_v_dim"]
        return (h * (2 * key + 2 * value + 2 * g["num_v_heads"]) + g["conv_kernel"] *
                (2 * key + value) + 2 * g["num_v_heads"] + g["head_v_dim"] + value * h)

    def expert_params(self) -> int:
        """Parameters of the experts (every MoE layer's ``[n, E, F]`` x 2 and ``[n, F, E]``;
        0 for a dense model): what the ``expert`` mesh axis splits."""
        return self.num_layers * self.num_experts * 3 * self.hidden_size * \
            self.moe_intermediate_size

    @property
    def active_intermediate(self) -> int:
        """The MLP width one token goes through: ``intermediate_size``, or ``k x
        moe_intermediate_size`` for a mixture of experts."""
        if self.num_experts:
            return self.num_experts_per_tok * self.moe_intermediate_size
        return self.intermediate_size

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        wq = 2 * q if self.attn_output_gate else q             # [query | gate] per head
        attn = h * wq + 2 * h * kv + q * h + (wq + 2 * kv if self.qkv_bias else 0)
        attn += 2 * d if self.qk_norm else 0
        mlp = h * self.num_experts if self.num_experts else 3 * h * i     # router, or the MLP
        fs = self.shared_expert_intermediate_size
        mlp += 3 * h * fs + h if fs else 0                       # shared expert and its gate
        linear = self.num_layers - self.attention_layers
        layers = self.attention_layers * attn + linear * self.gdn_params()
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + layers + self.num_layers * (mlp + 2 * h) + h + self.expert_params()

    def params_per_shard(self, shards: int, expert: int = 1) -> float:
        """Parameters one device holds with the weights split ``shards`` ways (``fsdp x
        tensor``) and the experts ``expert`` ways more (the ``expert`` axis)."""
        experts = self.expert_params()
        return ((self.num_params() - experts) + experts / expert) / shards


@dataclass(frozen=True)
class LearnerMemory:
    """Bytes per chip of each term (module doc) and their total."""
    params: float
    optimizer: float
    grads: float
    reference: float
    published: float
    activations: float

    @property
    def total(self) -> float:
        return (self.params + self.optimizer + self.grads + self.reference + self.published +
                self.activations)

    def describe(self) -> str:
        terms = ("params", "optimizer", "grads", "reference", "published", "activations")
        return ", ".join(f"{t} {getattr(self, t) / GIB:.1f}" for t in terms) + \
            f" = {self.total / GIB:.1f} GiB"


def activation_bytes(arch: Architecture, *, rows: float, seq: int, compute_bytes: int,
                     tensor: int = 1, remat: str = "none", scores_materialised: bool = True,
                     logits_chunk_tokens: int | None = None, sequence: int = 1,
                     expert: int = 1) -> float:
    """Bytes of one micro-batch's activations on one chip (module doc: the math per remat
    policy).

    Args:
      rows: rows per chip of a micro-batch; seq: tokens per row ``T``.
      compute_bytes: ``a``, bytes of the compute dtype; tensor: the tensor axis ``t``.
      remat: ``learner.remat``: "none", "full", "dots" or "offload".
      scores_materialised: whether attention holds float32 ``[T, T]`` scores per head.
      logits_chunk_tokens: tokens whose logits are held at once (None: every token).
      sequence: the ``sequence`` axis (context parallelism): a chip holds ``seq / sequence``
        positions of each row, and the all-gathered keys and values of the whole row.
      expert: the ``expert`` axis (mixture-of-experts layers: the dispatch's rows, module
        doc).

    Raises:
      ValueError: an unknown ``remat``.
    """
    a, t = compute_bytes, tensor
    h, i, d = arch.hidden_size, arch.active_intermediate, arch.head_dim
    q, kv = arch.num_heads, arch.num_kv_heads
    scores = 8 * (q / t) * seq if scores_materialised else 0.0
    if arch.num_experts:       # the dropless dispatch's rows per local token (module doc)
        pairs, f = expert * arch.num_experts_per_tok, arch.moe_intermediate_size
        mlp = a * (2 * (expert - 1) * h + pairs * (2 * h + 4 * f / t)) + 4 * arch.num_experts
        mlp_cotangents, mlp_dots = 3 * a * pairs * f / t, 2 * a * pairs * f / t
    else:
        mlp, mlp_cotangents, mlp_dots = 4 * a * i / t, 3 * a * i / t, 2 * a * i / t
    if remat not in ("none", "full", "offload", "dots"):
        raise ValueError(f"learner.remat must be one of none, full, dots, offload, got {remat!r}")
    # per kind of layer: (layers, A per token, the projections' outputs "dots" keeps)
    kinds = [(arch.attention_layers, a * (4 * h + 2 * (q + 2 * kv) * d / t) + mlp + scores,
              (q + 2 * kv) * d / t)]
    if arch.num_layers > arch.attention_layers:
        kinds.append((arch.num_layers - arch.attention_layers,) + _gdn_layer(arch, a, t, mlp))
    kept, working = 0.0, 0.0
    for n, layer, proj in kinds:
        if remat == "none":
            kept, working = kept + n * layer, max(working, layer + mlp_cotangents)
        elif remat in ("full", "offload"):
            kept, working = kept + n * a * h, max(working, layer + mlp_cotangents)
        else:
            kept, working = kept + n * (a * (h + proj + 2 * h) + mlp_dots), max(working, layer)
    tokens = rows * seq / sequence
    gathered = rows * seq * 4 * a * kv * d / t if sequence > 1 else 0.0
    head_tokens = tokens if logits_chunk_tokens is None else min(logits_chunk_tokens, tokens)
    logits = head_tokens * 12 * arch.vocab_size / t
    return tokens * kept + max(tokens * working + gathered, logits)


def _gdn_layer(arch: Architecture, a: int, t: int, mlp: float) -> tuple[float, float]:
    """``(A, projections)`` per token of a gated DeltaNet layer: norms / residuals ``4 h``; q, k, v, z projections ``2 k_d +
    2 v_d`` (``k_d = Hk dk``, ``v_d = Hv dv``), their conv outputs ``2 k_d + v_d``, the rule's
    output and the gated norm's ``2 v_d`` in the compute dtype; the rule's float32 q, k, v
    ``4 (2 k_d + v_d)`` and its chunk states, one float32 ``[Hv, dk, dv]`` per chunk of
    :data:`rlflow.models.gated_delta.DEFAULT_CHUNK` tokens; no ``[T, T]`` scores.

    Not calibrated, and short: XLA's compiled temporaries of the grad step (remat "full",
    one row, 1K-4K tokens, hidden 256, 8 layers ``[linear x3, full]``, DeltaNet 4 / 8 heads
    of 64) grow by ~340 KiB a token; this model's activations + gradients are 0.19-0.29x
    the compiled figure there (the same model with attention in every layer: 1.17x at 2K).
    The gated delta rule's own gradient takes ~54 KiB a token of it (8 heads of 64, one
    layer); where the rest goes is not found yet."""
    g, h = arch.gdn, arch.hidden_size
    key, value = g["num_k_heads"] * g["head_k_dim"], g["num_v_heads"] * g["head_v_dim"]
    states = 4 * g["num_v_heads"] * g["head_k_dim"] * g["head_v_dim"] / GDN_CHUNK
    layer = a * (4 * h + (4 * key + 5 * value) / t) + (4 * (2 * key + value) + states) / t
    return layer + mlp, (2 * key + 2 * value) / t


def learner_memory(arch: Architecture, cfg, *, scores_materialised: bool | None = None,
                   logits_chunk_tokens: int | None = None) -> LearnerMemory:
    """Per-chip memory of the learner of ``cfg`` (an ``ExperimentConfig``) for ``arch``.

    ``scores_materialised`` / ``logits_chunk_tokens``: as :func:`activation_bytes` (the
    attention implementation and the logprob chunking of the learner's forward); None
    (default) reads them from the config: scores are materialised only with
    ``learner.attention="xla"`` (every other implementation, "auto" included, holds one
    block of scores at a time), and logits are chunked by ``learner.logprob_chunk`` tokens
    (0: all at once).
    """
    lc, sc = cfg.learner, cfg.sampler
    mesh = lc.mesh
    if scores_materialised is None:
        scores_materialised = lc.attention == "xla"
    if logits_chunk_tokens is None:
        logits_chunk_tokens = lc.logprob_chunk or None
    n = arch.params_per_shard(mesh.fsdp * mesh.tensor, getattr(mesh, "expert", 1))
    pb = _BYTES[cfg.model.param_dtype]
    a = _BYTES[lc.compute_dtype]
    rows = lc.groups_per_step * sc.group_size / lc.micro_batches / mesh.batch_shards
    seq = max(lc.seq_buckets) if lc.seq_buckets else sc.max_prefill_length + sc.max_tokens
    act = activation_bytes(arch, rows=rows, seq=seq, compute_bytes=a, tensor=mesh.tensor,
                           remat=lc.remat, scores_materialised=scores_materialised,
                           logits_chunk_tokens=logits_chunk_tokens, sequence=mesh.sequence,
                           expert=getattr(mesh, "expert", 1))
    return LearnerMemory(params=n * pb, optimizer=2 * n * pb, grads=n * (4 + pb),
                         reference=n * pb if lc.kl_coef > 0 else 0.0,
                         published=(n * _BYTES[cfg.published_dtype]
                                    if _by_transfer(cfg) else 0.0),
                         activations=act)


def _by_transfer(cfg) -> bool:
    """Whether versions go by the transfer server, which holds the newest one on the
    learner's devices (:func:`rlflow.learner.publish.keeps_params` and ``published_params``),
    without importing jax: the TPU scripts evaluate the memory model where they are
    started."""
    return cfg.runtime.weight_transfer == "transfer"


def check_fits(arch: Architecture, cfg, chip_gib: float, *, headroom: float = 0.9
               ) -> LearnerMemory:
    """:func:`learner_memory`, raising when it exceeds ``headroom x chip_gib``.

    Raises:
      LearnerDoesNotFit: naming ``learner.mesh``, the per-chip terms and the capacity.
    """
    mem = learner_memory(arch, cfg)
    if mem.total > headroom * chip_gib * GIB:
        m = cfg.learner.mesh
        raise LearnerDoesNotFit(
            f"learner.mesh {m.describe()}: "
            f"{arch.num_params() / 1e9:.1f}B parameters need per chip {mem.describe()}, more "
            f"than {headroom:.0%} of a {chip_gib:.1f} GiB chip; use more chips (fsdp"
            f"{', or learner.mesh.expert for the experts' if arch.num_experts else ''}) or more "
            "learner.micro_batches")
    return mem
