"""The built-in demo, the default of ``rlflow train``: GRPO on the "next digit" task on CPU.

Task (``rlflow.data.tasks``, no download): the prompt is a digit and ``>`` ("7>"), the
answer the next digit ("8"); reward 0.9 for the right first character plus 0.1 for
stopping right after it (a stop token, the sampler's finish_reason: a completion cut at
``max_tokens`` decodes to the same text once special tokens are removed). A random model answers right about 1 time in 15, so the mean
reward starts near 0.1.

Model: a tiny Llama (hidden 64, 2 layers, 4 heads, 2 KV heads) with random weights and the
task's 15-token character tokenizer, written once as a Hugging Face folder (safetensors,
config.json, generation_config.json, tokenizer files) into
``$RLFLOW_CACHE_DIR/demo-model-<hash>`` (default ``~/.cache/rlflow``), so ``rlflow export``
and ``transformers`` can read the policy like any other checkpoint.

Run: the learner and the sampler as two processes with one CPU device each, asynchronous
with ``max_staleness`` 2; 8 prompts x 8 samples per step, up to 4 new tokens each, 300
steps (GRPO, lr 1e-3, no warm-start). Measured on 2 shared CPU cores (issue 39, six runs,
seeds 0-3): 39 s quiet, 64-131 s at load averages 11-18; the mean reward of the first 10%
of steps is 0.07-0.11 and of the last 10% 0.955-0.988, printed at the end and kept in
``runs/demo/summary.json``.

LoRA (``--learner.lora.rank 8``): adapters on every projection, and the token embedding and
the final RMSNorm scale trained whole (``learner.lora.train_embeddings`` /
``train_final_norm``, PEFT ``modules_to_save``), all at ``learner.lr``. The embedding is
needed because the base is random: its small frozen tied embedding (row norms ~0.16) caps
every logit after the final RMSNorm near 8 x 0.16, so the answer token's probability stays
near 0.2 whatever the adapters do (adapters alone: reward rise +0.24 and +0.05 in two
runs; an ``lm_head`` adapter instead: +0.40 and +0.07 in an on-policy stand-in loop).
Measured on 2 heavily shared CPU cores (~10 min each): reward rise +0.77 (0.08 -> 0.85,
seed 0) and +0.52 (0.09 -> 0.61, seed 1; ``--seed/--sampler.seed/--learner.seed``); at a
LoRA lr of 3e-3 it does not learn (+0.03, +0.02).
"""

import hashlib
import json
import os
import shutil
import tempfile

from rlflow.config import (BufferConfig, CheckpointConfig, ConfigError, DataConfig,
                           ExperimentConfig, LearnerConfig, LoraConfig, MetricsConfig, ModelConfig,
                           RewardConfig, RuntimeConfig, SamplerConfig)

TASK = "digits"
ARCH = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
            tie_word_embeddings=True)
INIT_SEED = 0


def cache_dir() -> str:
    return os.path.expanduser(os.environ.get("RLFLOW_CACHE_DIR", "~/.cache/rlflow"))


def build_model_folder(out_dir: str, *, task: str = TASK, arch: dict = ARCH,
                       init_seed: int = INIT_SEED) -> str:
    """Write the demo's random model and the task's tokenizer as a HF folder ``out_dir``.

    Written into a temporary sibling and renamed, so a reader never sees half a folder.
    Returns ``out_dir``.

    Raises:
      ConfigError: the parent folder cannot be written (names it and RLFLOW_CACHE_DIR).
    """
    from flax import nnx

    from rlflow.data.tasks import get_task
    from rlflow.models import Decoder, DecoderConfig, save_hf

    parent = os.path.dirname(os.path.abspath(out_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".demo-model-", dir=parent)
    except OSError as e:               # a read-only cache folder: one line, the way out
        raise ConfigError(f"cannot write the demo model to {parent} ({e.strerror or e}); set "
                          f"RLFLOW_CACHE_DIR to a writable folder (default ~/.cache/rlflow)"
                          ) from None
    tok = get_task(task).build_tokenizer(os.path.join(tmp, "tokenizer"))
    cfg = DecoderConfig.from_model_config(ModelConfig(vocab_size=len(tok), init_seed=init_seed,
                                                      **arch))
    cfg = cfg.replace(bos_token_id=tok.bos_token_id, eos_token_ids=(tok.eos_token_id,),
                      pad_token_id=tok.pad_token_id)
    model = Decoder(cfg, rngs=nnx.Rngs(params=init_seed))
    model_dir = os.path.join(tmp, "model")
    save_hf(model, cfg, model_dir, tokenizer_dir=os.path.join(tmp, "tokenizer"))
    try:
        os.rename(model_dir, out_dir)
    except OSError:
        if not os.path.isfile(os.path.join(out_dir, "config.json")):
            raise                       # else: another process built it first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def demo_model_path() -> str:
    """The cached demo model folder (built on first use)."""
    key = hashlib.sha256(json.dumps([TASK, ARCH, INIT_SEED], sort_keys=True).encode())
    path = os.path.join(cache_dir(), f"demo-model-{key.hexdigest()[:12]}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_model_folder(path)
    return path


def config() -> ExperimentConfig:
    group_size, groups, max_tokens = 8, 8, 4
    return ExperimentConfig(
        name="demo",
        run_dir="runs",
        model=ModelConfig(path=demo_model_path()),
        data=DataConfig(source="builtin", task=TASK, chat_template="none",
                        max_prompt_tokens=8),
        reward=RewardConfig(functions=("digits_match",), weights=(1.0,)),
        sampler=SamplerConfig(num_slots=32, max_prefill_length=8, prefill_buckets=(8,),
                              max_tokens=max_tokens, group_size=group_size, temperature=1.0),
        learner=LearnerConfig(num_steps=300, groups_per_step=groups, lr=1e-3,
                              advantage="grpo", loss_agg="token-mean", max_grad_norm=1.0,
                              seq_buckets=(16,),
                              # used with --learner.lora.rank R (off by default): see above
                              lora=LoraConfig(train_final_norm=True, train_embeddings=True)),
        buffer=BufferConfig(capacity=64, timeout_s=300.0),
        runtime=RuntimeConfig(mode="async", max_staleness=2, stale_policy="drop"),
        checkpoint=CheckpointConfig(every_steps=100, keep_last=1),
        metrics=MetricsConfig(samples_every=25, num_samples=8),
    )
