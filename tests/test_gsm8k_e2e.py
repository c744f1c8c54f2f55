"""Issue 6 acceptance: ``rlflow train --config configs/gsm8k.py --model.path <dir>`` runs 3
steps end to end on the real GSM8K test file, with a tiny local model and a BPE tokenizer
trained on the fly, the rewards going through math-verify.

The model folder is built in tmp: a tiny random Qwen2 (``tests/hf_fixtures.py``) whose
vocabulary is resized to the tokenizer's and whose special-token ids are the tokenizer's,
with the tokenizer files saved next to it.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from rlflow.run_folder import metrics_by_step, read_jsonl

from hf_fixtures import make_tiny_hf_model

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_TEST = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "gsm8k", "test.jsonl"))
HANG_GUARD_S = 300          # a run that takes longer than this is a hang (the test fails)
NUM_STEPS, GROUPS, GROUP_SIZE = 3, 2, 2


def _records():
    with open(GSM8K_TEST, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _build_model_folder(out_dir: str) -> int:
    """Tiny Qwen2 + BPE tokenizer trained on the GSM8K questions, one HF folder.

    Returns the vocabulary size (model == tokenizer)."""
    import transformers as tf

    from rlflow.data.tokenizer import build_bpe_tokenizer

    tok = build_bpe_tokenizer((r["question"] for r in _records()),
                              os.path.join(out_dir, "..", "tok"), vocab_size=512)
    make_tiny_hf_model("qwen2", out_dir)
    model = tf.AutoModelForCausalLM.from_pretrained(out_dir)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    for c in (model.config, model.generation_config):
        c.bos_token_id, c.eos_token_id = tok.bos_token_id, tok.eos_token_id
        c.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return len(tok)


@pytest.fixture(scope="module")
def gsm8k_run(tmp_path_factory):
    if not os.path.isfile(GSM8K_TEST):
        pytest.skip(f"GSM8K test file not found at {GSM8K_TEST} (the shared data folder)")
    root = tmp_path_factory.mktemp("gsm8k")
    model_dir = str(root / "model")
    vocab = _build_model_folder(model_dir)
    exe = shutil.which("rlflow", path=os.path.dirname(sys.executable))
    base = [exe] if exe else [sys.executable, "-m", "rlflow.cli"]
    cmd = base + ["train", "--config", os.path.join(REPO, "configs", "gsm8k.py"),
                  "--model.path", model_dir, "--data.path", GSM8K_TEST,
                  "--learner.num-steps", str(NUM_STEPS),
                  "--learner.groups-per-step", str(GROUPS),
                  "--sampler.group-size", str(GROUP_SIZE),
                  "--sampler.max-tokens", "8", "--sampler.num-slots", "4",
                  "--data.max-prompt-tokens", "128", "--sampler.max-prefill-length", "128",
                  "--sampler.prefill-buckets", "128",
                  "--metrics.samples-every", "1", "--metrics.num-samples", "8",
                  "--metrics.progress", "plain", "--buffer.timeout-s", "120",
                  "--run-dir", str(root / "runs")]
    env = dict(os.environ)
    env["RLFLOW_CACHE_DIR"] = str(root / "cache")
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    return proc, str(root / "runs" / "gsm8k"), model_dir, vocab


def test_three_steps_end_to_end(gsm8k_run):
    proc, run, model_dir, vocab = gsm8k_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    cfg = json.load(open(os.path.join(run, "config.json")))
    assert cfg["model"]["path"] == model_dir and cfg["data"]["path"] == GSM8K_TEST
    records, problems = read_jsonl(os.path.join(run, "metrics.jsonl"))
    assert not problems, problems
    by_step = metrics_by_step(records)
    assert sorted(by_step) == [1, 2, 3]
    for step, m in by_step.items():
        for name in ("reward/mean", "reward/std", "reward/min", "reward/max"):
            assert name in m and np.isfinite(m[name]), (step, name, m.get(name))
        assert 0.0 <= m["reward/min"] <= m["reward/mean"] <= m["reward/max"] <= 1.0
    model_cfg = json.load(open(os.path.join(model_dir, "config.json")))
    assert model_cfg["vocab_size"] == vocab          # the model's vocab is the tokenizer's
    # the sampler reports its reward-failure counters (a raising verifier is never silent)
    counts = [m["reward/errors/math_verify"] for m in by_step.values()
              if "reward/errors/math_verify" in m]
    assert counts and all(c == 0 for c in counts), counts


def test_rewards_go_through_math_verify(gsm8k_run):
    """The run's reward functions are exactly (math_verify,), its recorded rewards are in
    {0, 1}, and each recorded reward equals what the run's Rewarder (built from the run's
    config.json) gives that completion against the GSM8K answer of its prompt; the same
    Rewarder scores the reference number 1 and a wrong number 0."""
    from rlflow.config import RewardConfig
    from rlflow.data.rewarder import Rewarder
    from rlflow.data.rewards import final_answer_text

    proc, run, _, _ = gsm8k_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    reward_cfg = json.load(open(os.path.join(run, "config.json")))["reward"]
    assert list(reward_cfg["functions"]) == ["math_verify"]
    rewarder = Rewarder(RewardConfig(functions=tuple(reward_cfg["functions"]),
                                     weights=tuple(reward_cfg["weights"]),
                                     timeout_s=reward_cfg["timeout_s"]))
    samples, problems = read_jsonl(os.path.join(run, "samples.jsonl"))
    assert not problems, problems
    assert len(samples) == NUM_STEPS * GROUPS * GROUP_SIZE
    answers = {r["question"]: r["answer"] for r in _records()}
    for s in samples:
        assert s["reward"] in (0.0, 1.0), s
        matches = [q for q in answers if q in s["prompt"]]
        assert len(matches) == 1, s["prompt"]            # the prompt holds its GSM8K question
        answer = answers[matches[0]]
        assert float(rewarder.score_group(0, [s["completion"]], answer)[0]) == s["reward"]
        gold = final_answer_text(answer)
        wrong = str(int(float(gold)) + 1)
        got = rewarder.score_group(0, [f"So the answer is\n#### {gold}",
                                       f"So the answer is\n#### {wrong}"], answer)
        assert got.tolist() == [1.0, 0.0], (gold, got)
    assert sum(rewarder.metrics().values()) == 0     # no reward call raised or timed out
