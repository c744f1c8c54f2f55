"""`rlflow eval --model-path`: the demo model folder evaluated in-process on a held-out JSONL;
every figure checked against the samples it wrote and the task's reward written out here."""

import json
import os

import numpy as np

from tolerances import sum_tol

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
DEMO = os.path.join(REPO, "configs", "demo.py")


def held_out_digits(path, digits=range(10)):
    """A JSONL of "next digit" prompts in the demo data's record format."""
    with open(path, "w") as f:
        for d in digits:
            f.write(json.dumps({"question": f"{d}>", "answer": str((d + 1) % 10)}) + "\n")
    return str(path)


def _digits_reward(completion: str, answer: str) -> float:     # rlflow.data.tasks, by hand
    return 0.9 * float(completion[:1] == answer) + 0.1 * float(len(completion) == 1)


def test_eval_model_path_on_the_demo_folder(tmp_path, capsys):
    from rlflow.config import load_config_file
    from rlflow.console import cli

    held = held_out_digits(tmp_path / "held.jsonl")
    out = tmp_path / "out" / "metrics.json"
    model = load_config_file(DEMO).model.path
    status = cli.main(["eval", "--model-path", model, "--eval.source", "jsonl",
                       "--eval.path", held, "--eval.num-prompts", "6", "--eval.num-samples", "2",
                       "--eval.num-logged-samples", "6", "--out", str(out)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert f"metrics written to {out}" in captured.out
    # what it is doing, on stderr, before the figures (issue 49, fault 9: 2 minutes of silence)
    phases = [line for line in captured.err.splitlines() if line.startswith("rlflow eval: ")]
    assert phases == [f"rlflow eval: loading the model ({model})",
                      "rlflow eval: compiling prefill and decode, then generating 6 prompt(s) "
                      "x 2 sample(s)",
                      "rlflow eval: scoring 12 completion(s) with digits_match"], captured.err
    body = json.loads(out.read_text())
    m = body["metrics"]
    assert body["source"] == model and m["eval/version"] == 0
    assert m["eval/num_prompts"] == 6 and m["eval/num_samples"] == 2
    samples = [json.loads(line) for line in open(tmp_path / "out" / "metrics_samples.jsonl")]
    assert [s["prompt"] for s in samples] == [f"{d}>" for d in range(6)]   # file order
    for s in samples:            # each sample's reward is the task's reward of its text
        assert s["reward"] == np.float32(_digits_reward(s["completion"], s["answer"]))
        assert s["correct"] == (s["reward"] >= 0.45)
    # greedy (the eval default): both samples of a prompt are the same completion, so
    # pass@2 = pass@1 = maj@2 and the mean reward is that of the first samples
    assert m["eval/pass@2"] == m["eval/pass@1"] == m["eval/maj@2"]
    assert m["eval/pass@1"] == np.mean([s["correct"] for s in samples])
    rewards = [s["reward"] for s in samples]      # float64 both ways: only the sum's order
    np.testing.assert_allclose(m["eval/reward_mean"], np.mean(rewards), rtol=0, atol=sum_tol(
        2 * len(rewards), scale=max(map(abs, rewards)), eps=float(np.finfo(np.float64).eps)))
    assert 1 <= m["eval/completion_length"] <= 4     # demo sampler.max_tokens = 4
    # reward failures are counted (issue 49, fault 8): none for the demo's reward
    assert m["eval/reward_timeouts/digits_match"] == 0.0
    assert m["eval/reward_errors/digits_match"] == 0.0


def test_eval_refuses_a_missing_path_naming_the_field(capsys):
    from rlflow.config import load_config_file
    from rlflow.console import cli

    model = load_config_file(DEMO).model.path
    status = cli.main(["eval", "--model-path", model, "--eval.source", "jsonl"])
    assert status == 2
    assert "eval.path: is required for eval.source='jsonl'" in capsys.readouterr().err
