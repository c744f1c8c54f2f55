"""The sampler replica's side of the in-run evaluation, without a device: the held-out
requests go to the batcher, their groups are taken out before delivery and scored into one
result at the version named; newer weights pulled meanwhile are held back until the last
held-out prompt is decoded."""

import json
import threading

import numpy as np

from rlflow.config import DataConfig, EvalConfig, ExperimentConfig, RewardConfig, SamplerConfig
from rlflow.control import programs_common as pc
from rlflow.sampler.requests import CompletedGroup, Completion, Request


class Batcher:
    def __init__(self):
        self.requests, self.updates = [], []

    def submit(self, request):
        self.requests.append(request)

    def update_params(self, params, version):
        self.updates.append(version)


def _cfg(tmp_path):
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"question": f"{d}{d}>", "answer": str((d + 1) % 10)})
                            + "\n" for d in range(3)))
    return ExperimentConfig(
        data=DataConfig(source="builtin", task="digits", max_prompt_tokens=8),
        reward=RewardConfig(functions=("digits_match",), weights=(1.0,), num_workers=0),
        sampler=SamplerConfig(max_prefill_length=8, prefill_buckets=(8,), max_tokens=4),
        eval=EvalConfig(every_steps=2, source="jsonl", path=str(held), num_samples=2))


def _group(request, texts, tok, version):
    comps = []
    for i, text in enumerate(texts):
        ids = np.asarray(tok.encode(text, add_special_tokens=False), np.int32)
        comps.append(Completion(request.prompt_id, i, ids, np.zeros(len(ids), np.float32),
                                np.full(len(ids), version, np.int32), "stop"))
    return CompletedGroup(request, np.asarray(request.prompt_tokens), 4, comps)


def test_runner_scores_its_groups_and_leaves_training_groups_alone(tmp_path):
    from rlflow.sampler.eval_runner import EvalRunner

    cfg = _cfg(tmp_path)
    tok = pc.run_tokenizer(cfg)
    runner, batcher = EvalRunner(cfg, tok), Batcher()
    runner.start(2, 3, batcher)
    assert [tok.decode(r.prompt_tokens, skip_special_tokens=True) for r in batcher.requests] \
        == ["00>", "11>", "22>"]
    assert all(r.num_samples == 2 and r.sampling.temperature == 0 for r in batcher.requests)
    assert runner.decoding and runner.busy
    train = Request(prompt_id=7, prompt_tokens=[1, 2], num_samples=2)
    answers = {0: ["1", "5"], 1: ["2", "2"], 2: ["9", "7"]}     # correct samples: 1, 2, 0
    groups = [_group(r, answers[i], tok, 3) for i, r in enumerate(batcher.requests)]
    training = _group(train, ["3", "4"], tok, 3)
    assert runner.take([groups[0], training]) == [training]
    assert runner.decoding
    assert runner.take(groups[1:]) == [] and not runner.decoding
    runner.collect()
    (result,) = runner.take_results()
    assert runner.take_results() == [] and not runner.busy
    assert (result["requested"], result["version"]) == (2, 3)
    recs = sorted(result["records"], key=lambda r: r["prompt_id"])
    assert [r["correct"] for r in recs] == [[True, False], [True, True], [False, False]]
    assert [r["versions"] for r in recs] == [[3, 3]] * 3
    np.testing.assert_allclose(recs[0]["rewards"], [1.0, 0.1])    # 0.9 right + 0.1 one char
    runner.close()


def test_weights_pulled_during_an_evaluation_wait_for_its_last_prompt():
    from rlflow.sampler.program import SamplerProgram
    from rlflow.sampler.weight_pause import SwapPauseMeter

    class Evals:
        decoding = True

    p = object.__new__(SamplerProgram)
    p.evals, p.batcher, p._weights_lock = Evals(), Batcher(), threading.Lock()
    p.adapters, p.version, p.swap = None, 3, {}
    p.pause = SwapPauseMeter()
    p._on_weights(4, {"w": np.ones(2)}, 0.5)
    assert p.batcher.updates == [] and p.version == 3            # held back
    p._on_weights(5, {"w": np.ones(2)}, 0.5)                      # a newer one replaces it
    p._release_held_weights()
    assert p.batcher.updates == [] and p.version == 3            # still decoding
    p.evals.decoding = False
    p._release_held_weights()
    assert p.batcher.updates == [5] and p.version == 5 and p._held_weights is None
    p._on_weights(6, {"w": np.ones(2)}, 0.5)                      # no evaluation: at once
    assert p.batcher.updates == [5, 6] and p.version == 6


def test_a_nan_reward_scores_zero_in_the_evaluation(tmp_path):
    import dataclasses

    from rlflow.data.rewards import register_reward
    from rlflow.sampler.eval_runner import EvalRunner

    @register_reward("test_eval_nan_when_long")
    def nan_when_long(completion, answer):
        return float("nan") if len(completion) > 1 else 1.0

    cfg = _cfg(tmp_path)
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(
        cfg.eval, functions=("test_eval_nan_when_long",), weights=(1.0,)))
    tok = pc.run_tokenizer(cfg)
    runner, batcher = EvalRunner(cfg, tok), Batcher()
    runner.start(0, 0, batcher)
    runner.take([_group(r, ["1", "12"], tok, 0) for r in batcher.requests])
    runner.collect()
    (result,) = runner.take_results()
    assert [r["rewards"] for r in result["records"]] == [[1.0, 0.0]] * 3
    runner.close()


def test_the_evaluations_reward_failures_are_counted_apart_from_trainings(tmp_path):
    """A reward function that raises on the held-out samples: each failure is scored 0 and
    counted in the replica's status metrics as ``eval/reward_errors/<fn>`` (not in
    training's ``reward/errors/<fn>``, whose health check compares them with the training
    samples delivered)."""
    import dataclasses

    from rlflow.data.rewards import register_reward
    from rlflow.sampler.eval_runner import EvalRunner

    @register_reward("test_eval_raises_when_long")
    def raises_when_long(completion, answer):
        if len(completion) > 1:
            raise ValueError("too long")
        return 1.0

    cfg = _cfg(tmp_path)
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(
        cfg.eval, functions=("test_eval_raises_when_long",), weights=(1.0,)))
    tok = pc.run_tokenizer(cfg)
    runner, batcher = EvalRunner(cfg, tok), Batcher()
    assert runner.metrics() == {}                       # no evaluation yet
    runner.start(0, 0, batcher)
    runner.take([_group(r, ["1", "12"], tok, 0) for r in batcher.requests])
    runner.collect()
    (result,) = runner.take_results()
    assert [r["rewards"] for r in result["records"]] == [[1.0, 0.0]] * 3
    m = runner.metrics()
    assert m["eval/reward_errors/test_eval_raises_when_long"] == 3.0   # 3 prompts x 1 long
    assert not any(k.startswith("reward/") for k in m)
    runner.close()
