"""Test tolerances derived from the float arithmetic, the same on every machine (issue 14
item 10), never fitted to what one machine printed.

Rounding model (Higham, *Accuracy and Stability of Numerical Algorithms*, 2002): each float
operation rounds with relative error at most ``u = eps / 2``. A sum of ``n`` terms in any
order is off by at most ``(n - 1) u * sum|x_i|`` (eq. 4.4, first order), so two evaluations
in different orders (micro-batches, shards, another CPU's vector width, another XLA kernel)
differ by at most ``n * eps * sum|x_i|``. Errors along a chain of reductions add (to first
order): an output that passes through reductions of lengths ``n_1, n_2, ...`` carries a
relative error of at most ``(n_1 + n_2 + ...) * eps`` with respect to its absolute-value
counterpart. Each comparison in the tests states its ``n`` and its scale.
"""

from __future__ import annotations

import numpy as np

F32_EPS = float(np.finfo(np.float32).eps)      # 2**-23 ~ 1.19e-7
BF16_EPS = 2.0 ** -7                           # bfloat16: 8 significand bits (7 stored)


def sum_tol(n: int, scale: float = 1.0, eps: float = F32_EPS) -> float:
    """Bound on ``|a - b|`` for two evaluations of a sum of ``n`` terms in different orders:
    ``n * eps * scale`` with ``scale >= sum |x_i|`` (with ``scale = 1`` a relative bound
    for a sum of non-negative terms)."""
    return n * eps * scale


def chain_len(*, hidden: int, heads: int, head_dim: int, intermediate: int, layers: int,
              vocab: int, seq: int) -> int:
    """Total reduction length along a decoder's forward pass to one logprob: per layer the
    attention projections (hidden), scores (head_dim) and the weighted sum of values (seq),
    the output projection (heads * head_dim), the MLP (hidden, intermediate) and the norms
    (hidden); then the final norm, the LM head (hidden) and the log-softmax over the vocab."""
    per_layer = 3 * hidden + head_dim + seq + heads * head_dim + intermediate + hidden
    return layers * per_layer + 2 * hidden + vocab


def model_chain_len(cfg, seq: int) -> int:
    """:func:`chain_len` of a :class:`rlflow.config.ModelConfig` or
    :class:`rlflow.models.config.DecoderConfig` at sequence length ``seq``."""
    inter = cfg.intermediate_size
    if cfg.model_type in ("qwen3_moe", "gpt_oss"):
        # the router (hidden) and its softmax (experts), one expert's SwiGLU (its width),
        # the gates' renormalisation and the combine over the top-k
        inter = (cfg.moe_intermediate_size + cfg.hidden_size + cfg.num_experts
                 + 2 * cfg.num_experts_per_tok)
    return chain_len(hidden=cfg.hidden_size, heads=cfg.num_heads, head_dim=cfg.head_dim,
                     intermediate=inter, layers=cfg.num_layers, vocab=cfg.vocab_size, seq=seq)


def forward_atol(cfg, seq: int, scale: float, eps: float = F32_EPS) -> float:
    """Bound on ``|a - b|`` for logits / logprobs of one model computed by two different
    float32 programs (cached decode vs full forward, sharded vs one device, padded vs
    unpadded, rlflow vs transformers): each is within ``chain * eps * scale`` of the exact
    value, so they are within twice that of each other. ``scale`` bounds the magnitude of the
    values compared (e.g. ``max |logit|``)."""
    return 2 * model_chain_len(cfg, seq) * eps * scale


def reorder_rtol(chain: int, n: int, cancel: float = 1.0) -> float:
    """Relative bound for a per-token quantity of forward chain length ``chain`` summed over
    ``n`` positions, evaluated by two programs (micro-batches, shards): ``(2 chain + n) eps``
    times ``cancel`` = (sum of the absolute terms) / |result| (1 for non-negative terms)."""
    return (2 * chain + n) * F32_EPS * cancel


# A mixed-sign sum (policy loss, its gradients: advantages are zero-mean per group) can be
# much smaller than the sum of its absolute terms. Where that ratio is not computed, tests
# allow it to be up to this factor (test_micro_batch_accumulation_equals_one_batch computes it
# for the policy loss of its batch).
MIXED_SIGN_CANCEL = 16.0
