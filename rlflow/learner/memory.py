"""Learner memory per chip, computed from the architecture and the config (before any run).

What one chip of the learner mesh holds during a train step (bytes):

* parameters: ``N x param bytes / (fsdp x tensor)`` (replicated over ``data`` and
  ``sequence``);
* AdamW moments ``mu``, ``nu``: ``2 x N x param bytes / (fsdp x tensor)`` (optax keeps them in
  the parameters' dtype);
* gradients: ``N x (4 + param bytes) / (fsdp x tensor)``: the float32 accumulator over
  micro-batches and the micro-batch's own gradient being added to it (in the parameters'
  dtype); both are live through the backward pass (XLA's compiled temporaries hold two
  gradient-sized buffers also with one micro-batch, ``benchmarks/long_context.py``);
* KL reference copy (``learner.kl_coef > 0``): ``N x param bytes / (fsdp x tensor)``;
* the published version (``runtime.weight_transfer = "transfer"``): ``N x param bytes /
  (fsdp x tensor)``: the step keeps the params it was given, which the weight server may be
  sending, and writes the new ones beside them (``rlflow.learner.publish.keeps_params``);
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

``N`` counts embeddings, ``L`` layers of (q, k, v, o projections, gate/up/down MLP, two RMSNorm
scales), the final norm and (untied) the output projection, Qwen2's q/k/v biases included
when ``qkv_bias`` and Qwen3's q/k norm scales when ``qk_norm``. A mixture-of-experts model
(``num_experts`` n > 0, Qwen3-MoE) counts every expert in ``N`` (the router ``h x n`` and
``n`` SwiGLU experts of width ``moe_intermediate_size`` per layer: all are stored, trained
and published); its activations count the width a token actually goes through, ``i = k x
moe_intermediate_size`` (top-k), plus per token the dispatch's ``k`` copies of its input
and of the experts' outputs (``2 k h`` in the compute dtype) and the router's float32
probabilities (``4 n``) in ``A``. The activation term is an
estimate of what XLA keeps (it may fuse some away); the state terms are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlflow.config import ConfigError

GIB = 2 ** 30
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
    num_experts: int = 0             # Qwen3-MoE: experts per layer (0: dense MLP)
    num_experts_per_tok: int = 0     # top-k
    moe_intermediate_size: int = 0   # each expert's SwiGLU width

    @classmethod
    def from_model_config(cls, m) -> "Architecture":
        """From a :class:`rlflow.config.ModelConfig` (a random model's fields)."""
        moe = m.model_type == "qwen3_moe"
        return cls(m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads,
                   m.num_kv_heads, m.head_dim, m.tie_word_embeddings, m.model_type == "qwen2",
                   m.model_type in ("qwen3", "qwen3_moe"),
                   m.num_experts if moe else 0, m.num_experts_per_tok if moe else 0,
                   m.moe_intermediate_size if moe else 0)

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
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        mlp = (self.num_experts * (3 * h * self.moe_intermediate_size + h) if self.num_experts
               else 3 * h * i)
        layer = attn + mlp + 2 * h + (2 * d if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_layers * layer + h


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
                     logits_chunk_tokens: int | None = None, sequence: int = 1) -> float:
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

    Raises:
      ValueError: an unknown ``remat``.
    """
    a, t = compute_bytes, tensor
    h, i, d = arch.hidden_size, arch.active_intermediate, arch.head_dim
    q, kv = arch.num_heads, arch.num_kv_heads
    scores = 8 * (q / t) * seq if scores_materialised else 0.0
    routing = (2 * a * arch.num_experts_per_tok * h + 4 * arch.num_experts
               if arch.num_experts else 0.0)
    layer = a * (4 * h + 4 * i / t + 2 * (q + 2 * kv) * d / t) + scores + routing  # A, per token
    mlp_cotangents = 3 * a * i / t
    if remat == "none":
        kept, working = layer, layer + mlp_cotangents
    elif remat in ("full", "offload"):
        kept, working = a * h, layer + mlp_cotangents
    elif remat == "dots":
        kept, working = a * (h + (q + 2 * kv) * d / t + 2 * h + 2 * i / t), layer
    else:
        raise ValueError(f"learner.remat must be one of none, full, dots, offload, got {remat!r}")
    tokens = rows * seq / sequence
    gathered = rows * seq * 4 * a * kv * d / t if sequence > 1 else 0.0
    head_tokens = tokens if logits_chunk_tokens is None else min(logits_chunk_tokens, tokens)
    logits = head_tokens * 12 * arch.vocab_size / t
    return tokens * arch.num_layers * kept + max(tokens * working + gathered, logits)


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
    n = arch.num_params()
    shards = mesh.fsdp * mesh.tensor
    pb = _BYTES[cfg.model.param_dtype]
    a = _BYTES[lc.compute_dtype]
    rows = lc.groups_per_step * sc.group_size / lc.micro_batches / (mesh.data * mesh.fsdp)
    seq = max(lc.seq_buckets) if lc.seq_buckets else sc.max_prefill_length + sc.max_tokens
    act = activation_bytes(arch, rows=rows, seq=seq, compute_bytes=a, tensor=mesh.tensor,
                           remat=lc.remat, scores_materialised=scores_materialised,
                           logits_chunk_tokens=logits_chunk_tokens, sequence=mesh.sequence)
    return LearnerMemory(params=n * pb / shards, optimizer=2 * n * pb / shards,
                         grads=n * (4 + pb) / shards,
                         reference=n * pb / shards if lc.kl_coef > 0 else 0.0,
                         published=n * pb / shards if _keeps_params(cfg) else 0.0,
                         activations=act)


def _keeps_params(cfg) -> bool:
    """:func:`rlflow.learner.publish.keeps_params` (weights by transfer), without importing
    jax: the TPU scripts evaluate the memory model where they are started."""
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
            f"than {headroom:.0%} of a {chip_gib:.1f} GiB chip; use more chips (fsdp) or more "
            "learner.micro_batches")
    return mem
