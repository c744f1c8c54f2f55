"""GRPO on GSM8K with Qwen2.5-7B-Instruct and LoRA (rank 64 on every projection).

The full-weight 7B config (``configs/gsm8k_qwen2_5_7b.py``: data, reward, algorithm) with
LoRA (``learner.lora``): the base is frozen and stored in bfloat16, only the adapters
(float32, 161.5 M parameters) are trained, checkpointed and sent to the sampler (646 MB per
version instead of 15.2 GB). That halves the chips: learner on a v6e-4 (4 chips of 32 GB,
mesh fsdp=2 x tensor=2), sampler on a v6e-4 (mesh tensor=4, 4 KV heads over tensor; the
adapters merged into a working copy of the projections at each swap, the unmerged base kept:
``learner.lora.swap = "merged"``, decode at the plain model's speed).

    scripts/tpu/up.sh --zone ZONE --learner-type v6e-4 --sampler-type v6e-4 \\
        --config configs/gsm8k_qwen2_5_7b_lora.py --model-gcs gs://BUCKET/Qwen2.5-7B-Instruct \\
        --model-dir /home/$USER/Qwen2.5-7B-Instruct

Memory per chip (printed when the config is built; weights and optimiser state, without
activations, which the 32 micro-batches of 16 sequences keep to a few GB): see
:func:`memory_per_chip`. lr 2e-5 (LoRA typically takes 10-100x the full fine-tune's 5e-7).
"""

import dataclasses
import os

from rlflow.config import LoraConfig, MeshConfig, config_module

# Qwen2.5-7B (config.json of Qwen/Qwen2.5-7B-Instruct)
ARCH = dict(vocab=152064, hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4,
            head_dim=128)
RANK = 64
LEARNER_MESH = MeshConfig(fsdp=2, tensor=2)
SAMPLER_MESH = MeshConfig(tensor=4)


def _full_7b():
    return config_module(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "gsm8k_qwen2_5_7b.py"))


def parameter_counts(arch=ARCH, rank=RANK) -> tuple[int, int]:
    """``(base parameters, adapter parameters)``: LoRA ``A [in, r]`` + ``B [r, out]`` on
    q, k, v, o, gate, up, down of every layer."""
    e, f, h, k, d = (arch[n] for n in ("hidden", "intermediate", "heads", "kv_heads",
                                       "head_dim"))
    proj = [(e, h * d), (e, k * d), (e, k * d), (h * d, e), (e, f), (e, f), (f, e)]
    layer_base = sum(i * o for i, o in proj) + (h * d + 2 * k * d) + 2 * e   # + q/k/v bias, norms
    base = arch["layers"] * layer_base + 2 * arch["vocab"] * e + e           # untied embed/head
    adapters = arch["layers"] * sum(rank * (i + o) for i, o in proj)
    return base, adapters


def memory_per_chip(arch=ARCH, rank=RANK) -> dict[str, float]:
    """GB per chip: learner = bf16 base + fp32 adapters, their gradients and AdamW moments,
    and the published adapters the step keeps beside the new ones (weights go by transfer),
    all sharded over the learner's 4 chips; sampler = bf16 base + the merged bf16 working
    copy of every projection + fp32 adapters over its 4 chips (KV cache extra: num_slots x 2
    x layers x kv_heads x head_dim x length x 2 bytes)."""
    base, adapters = parameter_counts(arch, rank)
    e, f, h, k, d = (arch[n] for n in ("hidden", "intermediate", "heads", "kv_heads",
                                       "head_dim"))
    projections = arch["layers"] * (2 * e * h * d + 2 * e * k * d + 3 * e * f)
    gb = 1e9
    return {"learner_base": 2 * base / LEARNER_MESH.num_devices / gb,
            "learner_adapters_grads_adam": 20 * adapters / LEARNER_MESH.num_devices / gb,
            "sampler_base_adapters": (2 * base + 2 * projections + 4 * adapters)
            / SAMPLER_MESH.num_devices / gb,
            "bytes_per_version_gb": 4 * adapters / gb}


def config(model_path=None):
    cfg = _full_7b().config(model_path=model_path)
    replace = dataclasses.replace
    mem = memory_per_chip()
    print(f"gsm8k_qwen2_5_7b_lora: per chip: learner {mem['learner_base']:.1f} GB base + "
          f"{mem['learner_adapters_grads_adam']:.2f} GB adapters/grads/AdamW (+ activations); "
          f"sampler {mem['sampler_base_adapters']:.1f} GB weights (+ KV cache); "
          f"{mem['bytes_per_version_gb']:.2f} GB per published version")
    return replace(
        cfg,
        name="gsm8k_qwen2_5_7b_lora",
        model=replace(cfg.model, param_dtype="bfloat16"),
        sampler=replace(cfg.sampler, num_slots=128, num_devices=SAMPLER_MESH.num_devices,
                        mesh=SAMPLER_MESH),
        learner=replace(cfg.learner, lr=2e-5, num_devices=LEARNER_MESH.num_devices,
                        mesh=LEARNER_MESH,
                        lora=LoraConfig(rank=RANK, alpha=2.0 * RANK, swap="merged")),
    )
