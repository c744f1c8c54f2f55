"""A run folder belongs to one run (issue 14 item 7) and records each step once (item 8).

No JAX programs run: the launcher's children are stand-ins, the learner's order of
operations is checked on a :class:`LearnerProgram` built around fakes."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from rlflow import config as C
from rlflow.launcher import supervisor
from rlflow.control import programs_common as pc
from rlflow.learner.skips import SkipCounter
from rlflow.run.identity import (RUN_FILE, RunFolderConflict, check_run_folder,
                                 earlier_run_records, prepare_run_folder)

NOW = datetime.datetime(2026, 11, 30, 21, 0, 5, tzinfo=datetime.timezone.utc)


def _cfg(tmp_path, num_steps=3, resume="auto", overwrite=False, **changes):
    return C.ExperimentConfig(name="demo", run_dir=str(tmp_path),
                              learner=C.LearnerConfig(num_steps=num_steps),
                              checkpoint=C.CheckpointConfig(resume=resume, overwrite=overwrite),
                              metrics=C.MetricsConfig(progress="plain"), **changes)


def _earlier_run(tmp_path, cfg=None):
    """The issue's folder: checkpoints 15 and 20 and metrics 1..20 of an earlier run."""
    run = tmp_path / "demo"
    for step in (15, 20):
        (run / "checkpoints" / str(step)).mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(1, 21):
            f.write(json.dumps({"step": step, "learner/step_time_s": 0.1}) + "\n")
    pc.save_config(cfg or _cfg(tmp_path, num_steps=20), str(run / "config.json"))
    return run


def _no_spawn(self, role, instance=0):
    raise AssertionError(f"the launcher started the {role}")


def _listing(path):
    return sorted(os.path.relpath(os.path.join(d, n), path)
                  for d, dirs, files in os.walk(path) for n in dirs + files)


def test_resume_never_on_an_earlier_run_is_refused_naming_the_folder_and_ways_out(
        tmp_path, monkeypatch, capsys):
    run = _earlier_run(tmp_path)
    before = _listing(run)
    monkeypatch.setattr(supervisor.Supervisor, "start", _no_spawn)
    assert supervisor.run_train(_cfg(tmp_path, resume="never")) == 2
    err = capsys.readouterr().err
    assert f"run folder {run} holds an earlier run (checkpoints/, metrics.jsonl)" in err
    assert "--name NEW or --run_dir DIR" in err and "--checkpoint.overwrite true" in err
    assert _listing(run) == before                      # nothing touched


def test_resume_never_with_overwrite_moves_the_earlier_run_aside(tmp_path):
    run = _earlier_run(tmp_path)
    prepared = prepare_run_folder(_cfg(tmp_path, resume="never", overwrite=True), now=NOW)
    assert prepared.moved_to == f"{run}.replaced-20261130T210005Z"
    assert sorted(os.listdir(prepared.moved_to)) == ["checkpoints", "config.json",
                                                     "metrics.jsonl"]
    assert os.listdir(run) == [RUN_FILE]                # a clean folder: no old step 20
    manifest = json.loads((run / RUN_FILE).read_text())
    assert len(manifest["run_id"]) == 32 and manifest["created"] == "2026-11-30T21:00:05+00:00"
    # a second overwrite in the same second gets its own place
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    again = prepare_run_folder(_cfg(tmp_path, resume="never", overwrite=True), now=NOW)
    assert again.moved_to == f"{run}.replaced-20261130T210005Z-2"
    assert json.loads((run / RUN_FILE).read_text())["run_id"] != manifest["run_id"]


def test_the_issue_scenario_leaves_one_run_in_the_folder(tmp_path, monkeypatch, capsys):
    """3 steps with --checkpoint.resume never --checkpoint.overwrite true on the folder of a
    20-step run: the folder then holds checkpoint 3 and metrics 1, 2, 3 only, and a plain
    re-run says "already complete" at step 3 (not 20)."""
    run = _earlier_run(tmp_path)
    learner = ("import json, os, sys\n"
               "run = sys.argv[1]\n"
               "os.makedirs(os.path.join(run, 'checkpoints', '3'))\n"
               "with open(os.path.join(run, 'metrics.jsonl'), 'a') as f:\n"
               "    for s in (1, 2, 3):\n"
               "        f.write(json.dumps({'step': s, 'learner/step_time_s': 0.1}) + '\\n')\n")

    def fake_start(self, role, instance=0):
        code = learner if role == "learner" else "pass"
        proc = subprocess.Popen([sys.executable, "-c", code, str(run)])
        proc.wait()
        self.children[role] = supervisor.Child(role, proc, str(run / f"{role}.log"))
        return self.children[role]

    monkeypatch.setattr(supervisor.Supervisor, "start", fake_start)
    monkeypatch.setattr("rlflow.run.report.make_report", lambda run_dir: "report.html")
    cfg = _cfg(tmp_path, num_steps=3, resume="never", overwrite=True)
    assert supervisor.run_train(cfg) == 0
    out = capsys.readouterr().out
    assert f"moved the earlier run in {run} to {run}.replaced-" in out
    assert sorted(os.listdir(run / "checkpoints")) == ["3"]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    monkeypatch.setattr(supervisor.Supervisor, "start", _no_spawn)
    assert supervisor.run_train(_cfg(tmp_path, num_steps=3)) == 0
    assert "already complete (step 3 of 3)" in capsys.readouterr().out


def test_resume_auto_refuses_another_model_or_data_and_warns_on_other_changes(tmp_path):
    _earlier_run(tmp_path)
    other_model = _cfg(tmp_path, num_steps=20, model=C.ModelConfig(num_layers=3))
    with pytest.raises(RunFolderConflict, match=r"differs in model\.num_layers"):
        check_run_folder(other_model)
    other_data = _cfg(tmp_path, num_steps=20, data=C.DataConfig(shuffle_seed=7))
    with pytest.raises(RunFolderConflict, match=r"data\.shuffle_seed.*--checkpoint.overwrite"):
        check_run_folder(other_data)
    records, warnings = check_run_folder(_cfg(tmp_path, num_steps=40))   # extend the run
    assert records == ["checkpoints/", "metrics.jsonl"]
    assert len(warnings) == 1 and "learner.num_steps" in warnings[0]


@pytest.mark.parametrize("changes", [
    {"reward": C.RewardConfig(num_workers=1)},
    {"reward": C.RewardConfig(timeout_s=30.0)},
    {"reward": C.RewardConfig(memory_limit_mb=512)},
    {"data": C.DataConfig(on_bad_record="skip")},
    {"data": C.DataConfig(max_prompt_tokens=128, num_epochs=3)},
])
def test_resume_auto_allows_operational_changes_and_names_them(tmp_path, changes):
    _earlier_run(tmp_path)
    records, warnings = check_run_folder(_cfg(tmp_path, num_steps=20, **changes))
    assert records == ["checkpoints/", "metrics.jsonl"]
    section = next(iter(changes))
    assert len(warnings) == 1 and f"resuming with config changes in {section}." in warnings[0]


def test_resume_auto_refuses_another_reward_or_prompt_format(tmp_path):
    _earlier_run(tmp_path)
    for changes, field in [
            ({"reward": C.RewardConfig(weights=(2.0,))}, "reward.weights"),
            ({"data": C.DataConfig(prompt_field="q")}, "data.prompt_field"),
            ({"data": C.DataConfig(plain_template="Q: {prompt}")}, "data.plain_template")]:
        with pytest.raises(RunFolderConflict, match=rf"differs in {field}\b"):
            check_run_folder(_cfg(tmp_path, num_steps=20, **changes))


def _lora_cfg(tmp_path, **lora):
    cfg = _cfg(tmp_path, num_steps=20)
    return dataclasses.replace(cfg, learner=dataclasses.replace(
        cfg.learner, lora=C.LoraConfig(**{"rank": 8, **lora})))


def test_resume_auto_refuses_other_lora_adapters_and_allows_their_tuning(tmp_path):
    """Another adapter structure (rank, targets, what else is trained, LoRA on or off) has
    another checkpointed parameter tree: refused up front, the field named (before: the
    learner failed restoring the checkpoint); alpha / the adapters' lr / the swap mode may
    change."""
    _earlier_run(tmp_path, _lora_cfg(tmp_path))
    for cfg, field in [(_lora_cfg(tmp_path, rank=4), "learner.lora.rank"),
                       (_lora_cfg(tmp_path, rank=0), "learner.lora.rank"),
                       (_lora_cfg(tmp_path, targets=("q_proj",)), "learner.lora.targets"),
                       (_lora_cfg(tmp_path, train_final_norm=True),
                        "learner.lora.train_final_norm")]:
        with pytest.raises(RunFolderConflict, match=rf"LoRA adapters \(differs in {field}\)"):
            check_run_folder(cfg)
    _, warnings = check_run_folder(_lora_cfg(tmp_path, alpha=32.0, lr=1e-4, swap="forward"))
    assert len(warnings) == 1
    for field in ("learner.lora.alpha", "learner.lora.lr", "learner.lora.swap"):
        assert field in warnings[0]


def test_a_folder_with_only_config_and_logs_is_not_an_earlier_run(tmp_path):
    run = tmp_path / "demo"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "learner.log").write_text("start-up failed\n")
    (run / "checkpoints").mkdir()                       # empty: no checkpoint was written
    pc.save_config(_cfg(tmp_path), str(run / "config.json"))
    assert earlier_run_records(str(run)) == []
    assert prepare_run_folder(_cfg(tmp_path, resume="never"), now=NOW).moved_to is None


@pytest.mark.parametrize("resume", ["auto", "never"])
def test_a_rerun_after_a_failed_start_proceeds_with_other_settings(tmp_path, resume):
    """A start that failed before its first step (run.json, config.json, an empty
    checkpoints/, TensorBoard events, an empty metrics.jsonl, a 0-step summary) holds nothing
    to mix: a rerun with other model/data/reward settings proceeds and gets a new run.json."""
    first = prepare_run_folder(_cfg(tmp_path, data=C.DataConfig(shuffle_seed=3)), now=NOW)
    run = tmp_path / "demo"
    pc.save_config(_cfg(tmp_path, data=C.DataConfig(shuffle_seed=3)), str(run / "config.json"))
    (run / "checkpoints").mkdir()
    (run / "metrics.jsonl").write_text("")
    (run / "events.out.tfevents.1.host").write_bytes(b"\x18\x00")
    (run / "summary.json").write_text('{"steps_completed": 0}')
    assert earlier_run_records(str(run)) == []
    cfg = _cfg(tmp_path, resume=resume)
    assert check_run_folder(cfg) == ([], [])
    again = prepare_run_folder(cfg, now=NOW)
    assert again.moved_to is None and again.run_id != first.run_id
    assert json.loads((run / RUN_FILE).read_text())["identity"]["data"]["shuffle_seed"] == 0
    (run / "metrics.jsonl").write_text('{"step": 1}\n')          # one trained step: a run
    assert earlier_run_records(str(run)) == ["metrics.jsonl", "summary.json",
                                             "events.out.tfevents.1.host"]


def test_resume_keeps_the_run_id(tmp_path):
    cfg = _cfg(tmp_path, num_steps=20)
    first = prepare_run_folder(cfg, now=NOW)
    (tmp_path / "demo" / "metrics.jsonl").write_text('{"step": 1}\n')
    pc.save_config(cfg, str(tmp_path / "demo" / "config.json"))
    assert prepare_run_folder(cfg, now=NOW).run_id == first.run_id


def test_learner_refuses_resume_never_on_checkpoints_it_did_not_write(tmp_path):
    from rlflow.learner.program import LearnerProgram

    class Checkpoints:
        def latest_step(self):
            return 20

        def all_steps(self):
            return [15, 20]

    program = LearnerProgram.__new__(LearnerProgram)
    program.cfg, program.checkpointer = _cfg(tmp_path, resume="never"), Checkpoints()
    with pytest.raises(RunFolderConflict, match=r"steps \[15, 20\]"):
        program._resume()


# ------------------------------------------------------------------ item 8: step accounting

@pytest.fixture
def fresh_stop_state(monkeypatch):
    """Stop requests recorded by these tests do not leak to others of this process."""
    monkeypatch.setattr(pc, "_stop_requested", [])
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stop_swallowed_by_a_finaliser_still_stops_the_loop(fresh_stop_state):
    class Frame:                                 # like a ZeroMQ frame freed by the GC
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))                     # the handler runs (and raises) in here

    pc.install_signal_handlers()
    try:
        Frame()                                  # "Exception ignored in: ... __del__"
    except pc.Stopped:
        pass
    with pytest.raises(pc.Stopped, match="SIGTERM"):
        pc.raise_if_stopped()


def test_only_the_first_stop_request_raises(fresh_stop_state):
    """A launcher killed with SIGKILL sends its children several SIGTERMs (PDEATHSIG each
    time a child is handed to the next dying thread): the second must not cut the exit
    checkpoint (run in the handler of the first) short."""
    pc.install_signal_handlers()
    saved = []
    with pytest.raises(pc.Stopped, match="SIGTERM"):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))
        finally:                                 # the exit checkpoint
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))
            saved.append("whole")
    assert saved == ["whole"] and pc._stop_requested == [signal.SIGTERM] * 2
    with pytest.raises(pc.Stopped):
        pc.raise_if_stopped()                    # still stopping


def test_deferred_stop_raises_after_the_block(fresh_stop_state):
    done = []
    with pytest.raises(pc.Stopped, match="SIGTERM"):
        with pc.deferred_stop():
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("after the signal")
    assert done == ["after the signal"]
    assert signal.getsignal(signal.SIGTERM) is not None


class _Writer:
    def __init__(self):
        self.logged, self.samples = [], []

    def log(self, step, metrics):
        self.logged.append(step)
        self.metrics = metrics

    def samples_due(self, step):
        return True

    def log_samples(self, step, samples):
        self.samples.append(step)


class _Learner:
    version = 12
    last_compile_s = 0.0

    def build_batch(self, groups, version=None):
        return "batch", {"reward/mean": 0.5, "staleness/mean": 0.0, "batch/samples": 2,
                         "batch/groups": 1, "batch/loss_samples": 2}

    def dispatch(self, batch, checked=False):
        self.version += 1                  # the optimiser step is done ...
        os.kill(os.getpid(), signal.SIGTERM)   # ... and the launcher asks to stop
        return {}

    def perf_metrics(self, info, seconds):
        return {}


class _Coordinator:
    data_state = b""
    published_version = 12

    def set_progress(self, **kw):
        pass

    def latest_status(self):
        return None


def _stand_in_program(tmp_path, learner):
    """A LearnerProgram at version 12 whose buffer, coordinator, writer, publisher and prompt
    ledger are stand-ins: one group of 2 samples per step, without ledger keys."""
    from types import SimpleNamespace

    from rlflow.learner.program import LearnerProgram
    from rlflow.control.replica_metrics import StepRates
    from rlflow.control.ledger import PromptLedger, TrainedPromptsLog

    program = LearnerProgram.__new__(LearnerProgram)
    program.cfg = _cfg(tmp_path, num_steps=20)
    program.gps, program.threshold = 1, 0.5
    program.learner, program.writer = learner, _Writer()
    program.coordinator, program.version = _Coordinator(), 12
    program.rates = StepRates(0.0)
    program.counts = dict(accepted=12, stale_groups=0, zero_variance_groups=0)
    program.skips = SkipCounter(program.cfg)
    program.prefetch = lambda: None               # no buffer here
    program.take_groups = lambda taken=(): [{
        "rewards": np.array([0.0, 1.0]), "policy_versions": np.array([[12], [12]]),
        "completion_lengths": np.array([1, 1]), "prompt_id": np.int64(0),
        "prompt_tokens": np.array([3]), "completion_tokens": np.array([[4], [5]]),
        "truncated": np.array([False, False])}]
    program._publish = lambda: None
    program._buffer_metrics = lambda: {}
    program.tokenizer = SimpleNamespace(decode=lambda ids, **kw: str(ids))
    program.reasoning = None                      # not a thinking model
    program.ledger = PromptLedger(lambda i: {}, None, groups_per_step=1, max_staleness=0,
                                  seed_of=lambda i: i, trained_groups=12)
    program.batch_keys, program.steps_marked, program.prompts_per_epoch = [], 12, 1
    program.trained_log = TrainedPromptsLog(str(tmp_path), 12)
    program.prompt_counts, program._sampler_metrics = {}, lambda: {}
    program.publisher = SimpleNamespace(offers=None, bytes=0, transfer_metrics=dict)
    return program


def test_sigterm_after_the_optimiser_step_still_records_that_step(tmp_path, fresh_stop_state):
    """SIGTERM between the optimiser step and the metrics write: the step's metrics and
    samples are written before Stopped, so the exit checkpoint (of version 13) has them."""
    program = _stand_in_program(tmp_path, _Learner())
    previous = signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(pc.Stopped()))
    try:
        with pytest.raises(pc.Stopped):
            program.step()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert program.version == 13
    assert program.writer.logged == [13] and program.writer.samples == [13]


def test_the_learner_logs_no_always_zero_bad_reward_counter(tmp_path):
    """Only the sampler's sampler/dropped_bad_reward_groups counts groups dropped for a
    non-finite reward: the learner never receives one (records refuse them)."""

    class Learner(_Learner):
        def build_batch(self, groups, version=None):
            batch, info = super().build_batch(groups)
            return batch, dict(info, **{"batch/dropped_bad_reward_groups": 0,
                                        "batch/dropped_stale": 0})

        def dispatch(self, batch, checked=False):
            self.version += 1
            return {}

    program = _stand_in_program(tmp_path, Learner())
    program.step()
    assert program.writer.logged == [13]
    assert "batch/dropped_stale" in program.writer.metrics
    assert "batch/dropped_bad_reward_groups" not in program.writer.metrics
