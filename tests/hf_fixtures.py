"""Tiny random ``transformers`` models for parity tests (built locally, never downloaded)."""

from __future__ import annotations

import os

FAMILIES = ("llama", "qwen2", "qwen3")

# Llama-3 RoPE scaling with a small original context so that all three frequency bands
# (kept, smoothed, divided by `factor`) occur at head_dim 16.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def make_tiny_hf_model(family: str, out_dir: str, *, tie: bool | None = None, seed: int = 0) -> str:
    """Build a tiny random HF causal LM of ``family`` and ``save_pretrained`` it.

    Shapes: vocab 256, hidden 64, 2 layers, 4 query heads, 2 kv heads (GQA), head_dim 16
    (qwen3: 8, so that heads * head_dim != hidden), MLP 96. Llama gets Llama-3
    ``rope_scaling``; Qwen2 has q/k/v biases (set non-zero); Qwen3 q/k norms (set
    non-trivial). ``tie`` defaults to the family's usual choice (llama untied, qwen tied).

    Returns:
      ``out_dir`` (a folder with config.json, model.safetensors, generation_config.json).
    """
    import torch
    import transformers as tf

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    tie = (family != "llama") if tie is None else tie
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                  max_position_embeddings=256, tie_word_embeddings=tie,
                  bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0)
    if family == "llama":
        config = tf.LlamaConfig(head_dim=16, rope_parameters=dict(LLAMA3_ROPE), **common)
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        config = tf.Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                **common)
        cls = tf.Qwen2ForCausalLM
    else:
        config = tf.Qwen3Config(head_dim=8, rope_parameters={"rope_type": "default",
                                                             "rope_theta": 1000000.0}, **common)
        cls = tf.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:       # RMSNorm scales: perturb away from all-ones
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:                    # larger than HF's 0.02 so that logits are not flat
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir


# Generation settings of a released model's generation_config.json (issue 14 item 11).
GENERATION_SETTINGS = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
                       "repetition_penalty": 1.05}


def add_generation_settings(folder: str, **extra) -> dict:
    """Merge :data:`GENERATION_SETTINGS` (and ``extra``) into ``folder``'s
    generation_config.json; returns the file's new content."""
    import json

    path = os.path.join(folder, "generation_config.json")
    gen = {}
    if os.path.isfile(path):
        with open(path) as f:
            gen = json.load(f)
    gen.update(GENERATION_SETTINGS, **extra)
    with open(path, "w") as f:
        json.dump(gen, f, indent=2)
    return gen


def make_gsm8k_model_folder(out_dir: str, questions) -> int:
    """Tiny Qwen2 (:func:`make_tiny_hf_model`) + a BPE tokenizer (vocab 512) trained on
    ``questions`` (an iterable of str), one HF folder ``out_dir``: the model's vocabulary is
    resized to the tokenizer's and its bos/eos/pad ids are the tokenizer's.

    Returns the vocabulary size (model == tokenizer)."""
    import transformers as tf

    from rlflow.data.tokenizer import build_bpe_tokenizer

    tok = build_bpe_tokenizer(questions, os.path.join(out_dir, "..", "tok"), vocab_size=512)
    make_tiny_hf_model("qwen2", out_dir)
    model = tf.AutoModelForCausalLM.from_pretrained(out_dir)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    for c in (model.config, model.generation_config):
        c.bos_token_id, c.eos_token_id = tok.bos_token_id, tok.eos_token_id
        c.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return len(tok)


def make_tiny_hf_moe_model(out_dir: str, *, num_experts: int = 16, top_k: int = 2,
                           norm_topk_prob: bool = True, tie: bool = False, seed: int = 0,
                           num_layers: int = 2) -> str:
    """A tiny random ``Qwen3MoeForCausalLM`` (vocab 256, hidden 32, 4 query / 2 kv heads of
    head_dim 8, ``num_layers`` layers of ``num_experts`` experts of width 16, top-``top_k``
    routing), weights drawn as :func:`make_tiny_hf_model`'s, ``save_pretrained`` to
    ``out_dir``; returns ``out_dir``."""
    import torch
    import transformers as tf

    config = tf.Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
        rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        router_aux_loss_coef=0.01, bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0)
    torch.manual_seed(seed)
    model = tf.Qwen3MoeForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir


#: families whose layers come in several kinds (rlflow.models.layer_pattern)
PATTERN_FAMILIES = ("gemma3_text", "gpt_oss")
SLIDING_WINDOW = 4


def make_tiny_pattern_model(family: str, out_dir: str, *, seed: int = 0,
                            num_layers: int | None = None) -> str:
    """A tiny random Gemma 3 text or gpt-oss model, ``save_pretrained`` to ``out_dir``.

    Both have sliding-window layers of window :data:`SLIDING_WINDOW` (so test rows are
    longer than it) and a layer count that is not a multiple of the cycle (a remainder):

    * ``gemma3_text``: 5 layers ``[sliding, sliding, full] + [sliding, sliding]``, vocab 256,
      hidden 64, 4 query / 2 kv heads of head_dim 16, MLP 96, local RoPE base 10^4, global
      base 10^6 with linear scaling 8, ``query_pre_attn_scalar`` 24, final-logit softcap 30
      (Gemma 2's, which Gemma 3's code keeps), tied embeddings.
    * ``gpt_oss``: 3 layers ``[sliding, full] + [sliding]``, vocab 256, hidden 32, 4 / 2
      heads of head_dim 8, 4 experts of width 16, top-2, YaRN (factor 8, original context
      64), ``swiglu_limit`` 1.0 (so that the clamp binds), untied.

    Weights as :func:`make_tiny_hf_model` draws them (norm scales around their identity,
    biases and sinks non-zero)."""
    import torch
    import transformers as tf

    common = dict(vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, sliding_window=SLIDING_WINDOW,
                  bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0)
    if family == "gemma3_text":
        n = num_layers or 5
        config = tf.Gemma3TextConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=n, head_dim=16,
            layer_types=["full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                         for i in range(n)],
            query_pre_attn_scalar=24, final_logit_softcapping=30.0, tie_word_embeddings=True,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                             "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                "rope_theta": 1e6}}, **common)
        cls = tf.Gemma3ForCausalLM
    elif family == "gpt_oss":
        n = num_layers or 3
        config = tf.GptOssConfig(
            hidden_size=32, intermediate_size=16, num_hidden_layers=n, head_dim=8,
            num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.0,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 64}, **common)
        cls = tf.GptOssForCausalLM
    else:
        raise ValueError(f"family must be one of {PATTERN_FAMILIES}, got {family!r}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:       # Gemma's (1 + w) scales: w around 0; others around 1
                base = 0.0 if family == "gemma3_text" else 1.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias") or name.endswith("sinks"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir


def make_tiny_qwen35(out_dir: str, *, num_layers: int = 6, tie: bool = False,
                     seed: int = 0, moe: bool = False) -> str:
    """A tiny random ``Qwen3_5ForCausalLM`` (``qwen3_5_text``) saved by ``save_pretrained``:
    vocab 256, hidden 64, ``num_layers`` layers of HF's default pattern (three gated DeltaNet
    layers per gated full-attention layer; 6 layers: a cycle and a remainder of two), 4 query
    heads / 2 kv heads of head_dim 16 (partial rotary 0.25: 4 rotated dims), DeltaNet 2 key
    heads / 4 value heads of 8 / 12 dims, conv kernel 4. Norm offsets, A_log, dt_bias and
    biases perturbed so that none is trivial. ``moe``: ``Qwen3_5MoeForCausalLM``
    (``qwen3_5_moe_text``), every MLP 4 experts of width 32, top 2, and a shared expert of
    width 48 with its sigmoid gate. Returns ``out_dir``."""
    import torch
    import transformers as tf

    cls, extra = tf.Qwen3_5TextConfig, {}
    if moe:
        cls, extra = tf.Qwen3_5MoeTextConfig, dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48)
    config = cls(
        **extra, vocab_size=256, hidden_size=64, intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=tie, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_conv_kernel_dim=4, bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25})
    torch.manual_seed(seed)
    model = (tf.Qwen3_5MoeForCausalLM if moe else tf.Qwen3_5ForCausalLM)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen)
                        + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir
