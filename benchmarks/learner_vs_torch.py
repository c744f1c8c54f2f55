"""Learner train step against a PyTorch training step of the same Hugging Face model, same rows.

A random Qwen2-architecture model (transformers ``Qwen2ForCausalLM``, q/k/v biases, untied LM
head; defaults: hidden 256, 4 layers, 4 heads / 2 kv heads, MLP 896, vocab 2048: 4.5M
parameters, the issue-15 GSM8K size) is built with torch, ``save_pretrained`` to a temporary
folder and loaded by both sides: rlflow through ``model.path``, torch from the same folder.

The rows are one step's rollout groups (``BENCH_GROUPS`` x ``BENCH_G`` samples; prompt
lengths uniform in [``PROMPT_MIN``, ``PROMPT_MAX``], completion lengths in [``COMP_MIN``,
``COMP_MAX``]; random tokens). Each side does one whole optimiser step on them:

* rlflow: ``Learner.train_on(records)``: building the batch (and packing it, the default),
  host -> device transfer, forward, GRPO loss (decoupled PPO with truncated IS weights,
  token-mean), backward, gradient clipping, AdamW, metrics back on the host.
* torch: rows right-padded to the batch's longest row (prompt + completion), ``attention_mask``
  on the pads, forward, the same token-mean clipped-surrogate loss on completion tokens,
  backward, ``clip_grad_norm_`` and ``torch.optim.AdamW``; float32, ``torch.get_num_threads()``
  threads (printed).

Both process the same real tokens (prompt + completion of every row), so the headline is the
ratio of steps per second: ``learner_vs_torch_tokens_per_s`` = rlflow tokens/s / torch
tokens/s (target >= 1.5). Timing: best of ``BENCH_REPEATS`` steps per side, interleaved (the
machine is shared); each side's first steps (compilation / warm-up) are excluded. The
unpacked rlflow step (``learner.packing=False``, each row padded to the bucket) is measured in
the same run as a third line, with the padding fractions.

The script re-executes itself once with the glibc malloc settings ``rlflow train`` starts its
learner with (``rlflow.system.host_memory``); both sides run in that process, so torch gets
them too. ``BENCH_SYSTEM_MALLOC=1`` keeps the system's settings.

Sizes from environment variables (defaults in brackets): LVT_HIDDEN [256], LVT_LAYERS [4],
LVT_HEADS [4], LVT_KV_HEADS [2], LVT_MLP [896], LVT_VOCAB [2048], LVT_GROUPS [4], LVT_G [4],
LVT_PROMPT_MIN [32], LVT_PROMPT_MAX [128], LVT_COMP_MIN [16], LVT_COMP_MAX [64],
LVT_REPEATS [5], LVT_PACK_LENGTH [0: the config's default], LVT_SHARED [1: each group's prompt
packed once, ``learner.shared_prefix``; 0: a prompt copy per sample].
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import run_like_rlflow_train  # noqa: E402  (the script's folder)

MALLOC = run_like_rlflow_train()   # re-executes once, before jax is imported

import time  # noqa: E402

import numpy as np  # noqa: E402


def env(name, default):
    return int(os.environ.get(f"LVT_{name}", default))


HIDDEN, LAYERS, HEADS, KV_HEADS = env("HIDDEN", 256), env("LAYERS", 4), env("HEADS", 4), \
    env("KV_HEADS", 2)
MLP, VOCAB, GROUPS, G = env("MLP", 896), env("VOCAB", 2048), env("GROUPS", 4), env("G", 4)
PROMPT_MIN, PROMPT_MAX = env("PROMPT_MIN", 32), env("PROMPT_MAX", 128)
COMP_MIN, COMP_MAX, REPEATS = env("COMP_MIN", 16), env("COMP_MAX", 64), env("REPEATS", 5)
PACK_LENGTH, SHARED = env("PACK_LENGTH", 0), env("SHARED", 1)
CLIP_LOW, CLIP_HIGH, IS_CAP, LR = 0.2, 0.28, 2.0, 1e-5


def save_hf_model(out_dir: str) -> int:
    """A random Qwen2 model saved to ``out_dir``; returns its parameter count."""
    import torch
    import transformers as tf

    config = tf.Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP,
                            num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            num_key_value_heads=KV_HEADS, max_position_embeddings=1024,
                            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(config)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def make_records(rng) -> list:
    """One step's rollout group records (docs/interfaces.md)."""
    out = []
    for i in range(GROUPS):
        prompt = rng.integers(3, VOCAB, size=rng.integers(PROMPT_MIN, PROMPT_MAX + 1))
        lens = rng.integers(COMP_MIN, COMP_MAX + 1, size=G).astype(np.int32)
        ct = np.zeros((G, COMP_MAX), np.int32)
        mu = np.zeros((G, COMP_MAX), np.float32)
        ver = np.full((G, COMP_MAX), -1, np.int32)
        for s in range(G):
            ct[s, :lens[s]] = rng.integers(3, VOCAB, size=lens[s])
            mu[s, :lens[s]] = -np.log(VOCAB) + rng.normal(scale=0.1, size=lens[s])
            ver[s, :lens[s]] = 0
        out.append(dict(prompt_id=np.int64(i), prompt_tokens=prompt.astype(np.int32),
                        completion_tokens=ct, completion_lengths=lens, behaviour_logprobs=mu,
                        policy_versions=ver, rewards=rng.normal(size=G).astype(np.float32),
                        truncated=lens == COMP_MAX))
    return out


def make_learner(path: str, packing: bool):
    import jax

    from rlflow.config import (ExperimentConfig, LearnerConfig, MeshConfig, ModelConfig,
                               RuntimeConfig, SamplerConfig)
    from rlflow.learner.trainer import Learner
    from rlflow.mesh import make_mesh

    cfg = ExperimentConfig(
        model=ModelConfig(path=path),
        sampler=SamplerConfig(group_size=G, max_tokens=COMP_MAX, max_prefill_length=PROMPT_MAX,
                              prefill_buckets=(PROMPT_MAX,)),
        learner=LearnerConfig(groups_per_step=GROUPS, lr=LR, clip_low=CLIP_LOW,
                              clip_high=CLIP_HIGH, is_cap=IS_CAP, packing=packing,
                              pack_length=PACK_LENGTH if packing else 0,
                              shared_prefix=bool(SHARED)),
        runtime=RuntimeConfig(max_staleness=1000))
    return Learner(cfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]),
                   keep_params=True)   # as rlflow train runs it (weights go by transfer)


class TorchStep:
    """The torch side: same loss (decoupled PPO, old = current at step start, truncated IS
    weight ``min(exp(logp - mu), cap)``, token-mean), AdamW, rows padded to the longest."""

    def __init__(self, path: str, records):
        import torch
        import transformers as tf

        self.torch = torch
        self.model = tf.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.99),
                                     weight_decay=0.0)
        rows = []
        for rec in records:
            for s in range(G):
                n = int(rec["completion_lengths"][s])
                rows.append((rec["prompt_tokens"], rec["completion_tokens"][s, :n],
                             rec["behaviour_logprobs"][s, :n], float(rec["rewards"][s])))
        longest = max(len(p) + len(c) for p, c, _, _ in rows)
        b = len(rows)
        ids = np.zeros((b, longest), np.int64)
        attn = np.zeros((b, longest), np.int64)
        mask = np.zeros((b, longest), np.float32)       # aligned with targets ids[:, 1:]
        mu = np.zeros((b, longest), np.float32)
        adv = np.zeros((b, longest), np.float32)
        rewards = np.array([r for *_, r in rows], np.float32).reshape(-1, G)
        a = ((rewards - rewards.mean(1, keepdims=True)) /
             (rewards.std(1, keepdims=True) + 1e-6)).reshape(-1)
        for i, (p, c, m, _) in enumerate(rows):
            n_p, n_c = len(p), len(c)
            ids[i, :n_p], ids[i, n_p:n_p + n_c] = p, c
            attn[i, :n_p + n_c] = 1
            mask[i, n_p - 1:n_p - 1 + n_c] = 1
            mu[i, n_p - 1:n_p - 1 + n_c] = m
            adv[i, n_p - 1:n_p - 1 + n_c] = a[i]
        t = torch.from_numpy
        self.ids, self.attn, self.mask, self.mu, self.adv = t(ids), t(attn), t(mask), t(mu), t(adv)
        self.real_tokens = int(attn.sum())
        self.shape = ids.shape

    def step(self) -> float:
        torch = self.torch
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(input_ids=self.ids, attention_mask=self.attn).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(
            -1, self.ids[:, 1:, None]).squeeze(-1)
        m, mu, adv = self.mask[:, :-1], self.mu[:, :-1], self.adv[:, :-1]
        old = logp.detach()
        ratio = torch.exp(logp - old)
        w = torch.clamp(torch.exp(old - mu), max=IS_CAP) * m
        per_tok = torch.maximum(-adv * ratio,
                                -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
        loss = (w * per_tok).sum() / m.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return float(loss.detach())


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import torch

    rng = np.random.default_rng(0)
    records = make_records(rng)
    with tempfile.TemporaryDirectory(prefix="lvt-") as path:
        n_params = save_hf_model(path)
        packed = make_learner(path, packing=True)
        padded = make_learner(path, packing=False)
        ref = TorchStep(path, records)
    # one step's metrics and warm-up (compilation) on each side, then interleaved repeats
    info_p = packed.train_on(records)
    info_u = padded.train_on(records)
    ref.step()
    best = {"packed": float("inf"), "padded": float("inf"), "torch": float("inf")}
    for _ in range(REPEATS):
        best["packed"] = min(best["packed"], timed(lambda: packed.train_on(records)))
        best["padded"] = min(best["padded"], timed(lambda: padded.train_on(records)))
        best["torch"] = min(best["torch"], timed(ref.step))
    tok = ref.real_tokens
    rows_u = f"{GROUPS * G}x{int(info_u['batch/seq_len'])}"
    config = (f"Qwen2 {n_params / 1e6:.1f}M params (hidden {HIDDEN}, {LAYERS} layers, vocab "
              f"{VOCAB}), {GROUPS * G} rows, {tok} real tokens, float32, AdamW; torch "
              f"{torch.get_num_threads()} threads; {MALLOC}")
    print(f"RESULT learner_vs_torch_rlflow_tokens_per_s {tok / best['packed']:.1f} tokens/s "
          f"packed {int(info_p['batch/packed_rows'])}x{packed.pack_spec.pack_length}; "
          f"padding {info_p['learner/packed_padding_fraction']:.2f}; step "
          f"{best['packed'] * 1e3:.0f} ms incl. batch building")
    print(f"RESULT learner_vs_torch_rlflow_unpacked_tokens_per_s {tok / best['padded']:.1f} "
          f"tokens/s rows padded to the bucket {rows_u}; padding "
          f"{info_u['learner/padding_fraction']:.2f}; step {best['padded'] * 1e3:.0f} ms")
    pad_t = 1 - tok / (ref.shape[0] * ref.shape[1])
    print(f"RESULT learner_vs_torch_torch_tokens_per_s {tok / best['torch']:.1f} tokens/s torch "
          f"forward+backward+AdamW, rows padded to the longest {ref.shape[0]}x{ref.shape[1]}; "
          f"padding {pad_t:.2f}; step {best['torch'] * 1e3:.0f} ms (baseline)")
    print(f"RESULT learner_vs_torch_unpacked {best['torch'] / best['padded']:.2f} x rlflow "
          f"unpacked over torch")
    print(f"RESULT learner_vs_torch_tokens_per_s {best['torch'] / best['packed']:.2f} x "
          f"target>=1.5; {config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
