"""End-to-end GRPO on GSM8K: completion tokens trained per second, async and sync.

``rlflow train`` (``rlflow.launcher.supervisor.run_train``: learner and sampler as separate
processes) on ``configs/gsm8k.py`` with the benchmarks' headline model
(``benchmarks/_gsm8k_model.py``: a random Qwen2 of 4.46M parameters, hidden 256, 4 layers,
byte-level BPE vocabulary of 2048 trained here on GSM8K, saved as a local Hugging Face
folder), the real ``train.jsonl`` prompts and math-verify rewards. Sizes of the issue's
measurement: group size 4, 16 completions of at most 64 tokens per step, prompts of at most
128 tokens; lr 1e-6, so completion lengths (and the work per step) stay put through the run.

Figure: completion tokens trained per second = the loss tokens (``learner/tokens``) of the
steps after the first ``WARMUP`` (start-up and compilation excluded) / the wall time between
the metrics records of the first and last of them (``metrics.jsonl`` ``time``), less the time
those steps spent compiling a new packed shape (``learner/compile_s``). Two modes,
one after the other: ``sync`` (``max_staleness=0``) and ``async`` (``max_staleness=2``), each
program pinned to its own core (``runtime.pin_cpus``, the CPU stand-in for two accelerator
slices), and their ratio. Also printed: the mean learner step time and the learner's wait
for rollouts per step (where the time goes).

Sizes: ``BENCH_STEPS`` (default 30) steps per run, ``BENCH_WARMUP`` (default 6) not
counted; about 4 minutes on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import _gsm8k_model  # noqa: E402
from _runs import mean_train_s, steady_steps, steady_wall  # noqa: E402

STEPS = int(os.environ.get("BENCH_STEPS", "30"))
WARMUP = int(os.environ.get("BENCH_WARMUP", "6"))
GROUPS, GROUP_SIZE, MAX_TOKENS, MAX_PROMPT = 4, 4, 64, 128


def build_model_folder(out_dir: str) -> str:
    """The headline model with its GSM8K BPE tokenizer, as one HF folder."""
    from rlflow.models import build_model, save_hf

    tok_dir = os.path.join(out_dir, "tokenizer")
    tok = _gsm8k_model.build_tokenizer(tok_dir)
    model, cfg = build_model(_gsm8k_model.model_config(len(tok)))
    cfg = dataclasses.replace(cfg, bos_token_id=tok.bos_token_id,
                              eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    model_dir = os.path.join(out_dir, "model")
    save_hf(model, cfg, model_dir, tokenizer_dir=tok_dir)
    return model_dir


def experiment(model_dir: str, run_dir: str, mode: str):
    from rlflow import config as C

    sys.path.insert(0, os.path.join(_gsm8k_model.REPO, "configs"))
    import gsm8k
    base = gsm8k.config()
    return dataclasses.replace(
        base, name=f"e2e_{mode}", run_dir=run_dir,
        model=C.ModelConfig(path=model_dir),
        data=dataclasses.replace(base.data, path=_gsm8k_model.GSM8K_PATH,
                                 max_prompt_tokens=MAX_PROMPT),
        sampler=dataclasses.replace(base.sampler, num_slots=GROUPS * GROUP_SIZE,
                                    max_prefill_length=MAX_PROMPT,
                                    prefill_buckets=(64, MAX_PROMPT), max_tokens=MAX_TOKENS,
                                    group_size=GROUP_SIZE),
        learner=dataclasses.replace(base.learner, num_steps=STEPS, groups_per_step=GROUPS,
                                    warmup_steps=0),
        runtime=C.RuntimeConfig(mode=mode, max_staleness=0 if mode == "sync" else 2,
                                pin_cpus=True),
        checkpoint=C.CheckpointConfig(every_steps=0),
        metrics=C.MetricsConfig(samples_every=0, progress="plain"))


def measure(cfg) -> dict:
    steps, times, by_step = steady_steps(cfg, WARMUP)
    wall, compile_s = steady_wall(steps, times, by_step)
    # tokens of the steps after the first counted one: those trained inside `wall`
    tokens = sum(by_step[s]["learner/tokens"] for s in steps[1:])
    mean = lambda k: float(np.mean([by_step[s][k] for s in steps]))  # noqa: E731
    return {"tokens_per_s": tokens / wall, "steps_per_s": (len(steps) - 1) / wall,
            "tokens_per_step": tokens / (len(steps) - 1),
            "train_s": mean_train_s(steps, by_step),
            "wait_s": mean("buffer/consumer_wait_s"), "compile_s": compile_s}


def main() -> int:
    root = tempfile.mkdtemp(prefix="rlflow-bench-e2e-")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(root, "xla-cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    model_dir = build_model_folder(root)
    out = {}
    for mode in ("sync", "async"):
        out[mode] = got = measure(experiment(model_dir, os.path.join(root, "runs"), mode))
        print(f"# {mode}: {got}", file=sys.stderr, flush=True)
    note = (f"GSM8K, qwen2 4.46M BPE-2048, {GROUPS}x{GROUP_SIZE} completions/step of <= "
            f"{MAX_TOKENS} tokens, steps {WARMUP + 1}-{STEPS} counted, programs pinned")
    for mode, got in out.items():
        print(f"RESULT e2e_{mode}_completion_tokens_per_s {got['tokens_per_s']:.1f} tokens/s "
              f"max_staleness={0 if mode == 'sync' else 2}, {got['tokens_per_step']:.0f} "
              f"tokens/step, {note}")
        print(f"RESULT e2e_{mode}_train_s_per_step {got['train_s']:.3f} s the jitted train step")
        print(f"RESULT e2e_{mode}_rollout_wait_s_per_step {got['wait_s']:.3f} s the learner's "
              f"wait for a step's groups")
    print(f"RESULT e2e_async_vs_sync {out['async']['tokens_per_s'] / out['sync']['tokens_per_s']:.2f}"
          f" x completion tokens trained per second, async over sync")
    return 0


if __name__ == "__main__":
    sys.exit(main())
