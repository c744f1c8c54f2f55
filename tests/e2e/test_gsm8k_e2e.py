"""Issue 6 acceptance: ``rlflow train --config configs/gsm8k.py --model.path <dir>`` runs 3
steps end to end on the real GSM8K test file, with a tiny local model and a BPE tokenizer
trained on the fly, the rewards going through math-verify.

The model folder is conftest's ``gsm8k_model`` (shared with tests/e2e/test_episodes_e2e.py): a
tiny random Qwen2 (``tests/hf_fixtures.py``) whose vocabulary is resized to the tokenizer's
and whose special-token ids are the tokenizer's, with the tokenizer files saved next to it.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from rlflow.run.folder import metrics_by_step, read_jsonl

from conftest import GSM8K_TEST, gsm8k_records

pytestmark = pytest.mark.slow

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HANG_GUARD_S = 300          # a run that takes longer than this is a hang (the test fails)
NUM_STEPS, GROUPS, GROUP_SIZE = 3, 2, 2


@pytest.fixture(scope="module")
def gsm8k_run(tmp_path_factory, gsm8k_model):
    root = tmp_path_factory.mktemp("gsm8k")
    model_dir, vocab = gsm8k_model
    exe = shutil.which("rlflow", path=os.path.dirname(sys.executable))
    base = [exe] if exe else [sys.executable, "-m", "rlflow.console.cli"]
    cmd = base + ["train", "--config", os.path.join(REPO, "configs", "gsm8k.py"),
                  "--metrics.report", "False",
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
    answers = {r["question"]: r["answer"] for r in gsm8k_records()}
    for s in samples:
        assert s["reward"] in (0.0, 1.0), s
        matches = [q for q in answers if q in s["prompt"]]
        assert len(matches) == 1, s["prompt"]            # the prompt holds its GSM8K question
        answer = answers[matches[0]]
        ended = ["length" if s["truncated"] else "stop"]   # as the sampler told the reward
        assert float(rewarder.score_group(0, [s["completion"]], answer, ended)[0]) == s["reward"]
        gold = final_answer_text(answer)
        wrong = str(int(float(gold)) + 1)
        got = rewarder.score_group(0, [f"So the answer is\n#### {gold}",
                                       f"So the answer is\n#### {wrong}"], answer)
        assert got.tolist() == [1.0, 0.0], (gold, got)
    assert sum(rewarder.metrics().values()) == 0     # no reward call raised or timed out
