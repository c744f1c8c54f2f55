"""The benchmarks' headline model: a Qwen2-architecture model of ~4.5M parameters with a
byte-level BPE vocabulary of 2048 trained here on GSM8K text (not a benchmark itself:
bench.sh runs only files without a leading underscore).

Sizes (issue 15): hidden 256, 4 layers, 4 query heads of 64, 2 KV heads, MLP 1024, tied
embeddings, vocab 2048: 4.46M parameters, big enough that a decode step is matrix work
rather than Python overhead. The tokenizer is trained on the questions and answers of
``../shared/data/gsm8k/train.jsonl`` (``GSM8K_PATH`` overrides), a few seconds on one core.
"""

from __future__ import annotations

import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_PATH = os.environ.get("GSM8K_PATH", os.path.normpath(
    os.path.join(REPO, "..", "shared", "data", "gsm8k", "train.jsonl")))
VOCAB = 2048


def gsm8k_texts(path: str = GSM8K_PATH) -> list[str]:
    """Question and answer texts of a GSM8K JSONL file.

    Raises:
      FileNotFoundError: no file at ``path`` (names it and the ``GSM8K_PATH`` override).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GSM8K JSONL not found at {path!r} (set GSM8K_PATH)")
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out += [rec["question"], rec["answer"]]
    return out


def build_tokenizer(out_dir: str, vocab_size: int = VOCAB):
    """Train the BPE tokenizer on GSM8K into ``out_dir``; returns it (HF fast tokenizer)."""
    from rlflow.data.tokenizer import build_bpe_tokenizer
    return build_bpe_tokenizer(gsm8k_texts(), out_dir, vocab_size=vocab_size)


def model_config(vocab_size: int = VOCAB, *, hidden: int = 256, layers: int = 4, **overrides):
    """The Qwen2 ``ModelConfig`` of the headline model (heads of 64, 2 KV heads, MLP 4x)."""
    from rlflow.config import ModelConfig
    heads = max(hidden // 64, 1)
    kw = dict(model_type="qwen2", vocab_size=vocab_size, hidden_size=hidden,
              intermediate_size=4 * hidden, num_layers=layers, num_heads=heads,
              num_kv_heads=max(heads // 2, 1), head_dim=hidden // heads,
              tie_word_embeddings=True)
    kw.update(overrides)
    return ModelConfig(**kw)


def gsm8k_prompts(tokenizer, n: int, length: int) -> "list[list[int]]":
    """``n`` GSM8K questions as token ids, each cut or repeated to exactly ``length``."""
    out = []
    for text in gsm8k_texts()[0::2]:
        ids = tokenizer(text)["input_ids"]
        while len(ids) < length:
            ids = ids + ids
        out.append(ids[:length])
        if len(out) == n:
            break
    return out
