"""Shared pieces of the 2026 families' transformers parity tests (tests/unit/models/
test_hf_families.py, test_qwen35.py): the token rows, rlflow's jitted forward, transformers'
float32 logits of a folder, the two-program bound and the left-padded batch of the rows."""

from __future__ import annotations

import functools

import numpy as np
import torch
from flax import nnx

import jax.numpy as jnp
from rlflow.models import positions_from_mask
from tolerances import forward_atol

# three rows of different lengths; the longest is over twice the families' sliding window
SEQS = [np.array(s, np.int32) for s in
        ([17, 200, 31, 4, 99, 250, 8, 64, 128, 7, 11], [5, 77, 190, 3, 42, 9, 13], [211, 9])]
forward = nnx.jit(lambda m, t, p, mask: m(t, p, mask))


@functools.cache
def hf_model(path: str, attn_implementation: str | None = None):
    """transformers' float32 model of the folder ``path`` (eval mode, cached per path)."""
    from transformers import AutoModelForCausalLM
    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def hf_logits(path: str, seq: np.ndarray, attn_implementation: str | None = None) -> np.ndarray:
    """transformers' logits ``[len(seq), vocab]`` float32 of the one row ``seq``."""
    with torch.no_grad():
        model = hf_model(path, attn_implementation)
        return model(input_ids=torch.tensor(seq[None]).long()).logits[0].numpy()


def atol(cfg, seq, ref) -> float:
    """The bound on two float32 programs' logits (tests/tolerances.py) at ``ref``'s scale."""
    return forward_atol(cfg, seq, float(np.abs(ref).max()))


def left_padded_logits(model) -> tuple[np.ndarray, int]:
    """rlflow's logits ``[len(SEQS), w, vocab]`` of :data:`SEQS` left-padded to the longest
    row's length ``w``, and ``w`` (row b's tokens sit at ``[w - len(SEQS[b]):]``)."""
    w = max(map(len, SEQS))
    toks, mask = np.zeros((len(SEQS), w), np.int32), np.zeros((len(SEQS), w), bool)
    for b, s in enumerate(SEQS):
        toks[b, w - len(s):], mask[b, w - len(s):] = s, True
    return np.asarray(forward(model, jnp.asarray(toks), positions_from_mask(mask),
                              jnp.asarray(mask))), w
