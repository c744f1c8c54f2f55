"""Issue 53, acceptance: a sampler replica, the learner, then the launcher are killed (-9)
in the middle of long generations (one run, three launches; the single-turn case kills the
sampler replica only, one launch: the suite's time); with the journal of partial
generations the restarted replica and the resumed runs resume them, and every completion
trained equals, token for token, that of an uninterrupted sync-mode run with the same
seeds, each prompt of the stream trained once (the trained-prompts log). Two replicas; the demo's
tiny model on CPU, long completions, small decode calls, the journal on disk never more than
``sampler.journal_every_steps`` decode calls behind (``sampler/journal_lag_max``).

Two cases: single-turn (configs/demo.py) and multi-turn episodes (configs/multiturn_demo.py:
``guess_digit`` episodes, the same tiny model with the task's chat template; every episode's
ids, the environment's answers between its turns included, equal the uninterrupted run's,
and each kill comes while a journal holds an episode past its first turn, so the resumed
replicas rebuild environments by replaying turns, ``sampler/episodes_resumed``).

Each kill is aimed by freezing the replicas (SIGSTOP) and reading their journals: the kill
comes when one holds a sample in mid-decode of the learner's current version (multi-turn:
with the environment's ids of an earlier turn; and, for the learner's kill, once its
checkpoint of that version is written); otherwise they go on (SIGCONT) and it looks again.
"""

import functools
import json
import os
import re
import signal
import subprocess
import time

import pytest

from e2e_runs import demo_train_cmd
from repo_paths import REPO
from rlflow.control.ledger import read_trained_prompts
from rlflow.run import journal
from test_replicas_e2e import _finish
from test_runtime_e2e import HANG_GUARD_S, _steps, _wait_for_step, env  # noqa: F401

pytestmark = pytest.mark.slow

STEPS, GROUPS, G, REPLICAS, EVERY = 5, 4, 4, 2, 2
ARGS = ("--runtime.mode", "sync", "--runtime.max_staleness", "0",
        "--learner.num_steps", str(STEPS), "--learner.groups_per_step", str(GROUPS),
        "--sampler.num_replicas", str(REPLICAS),
        "--sampler.group_size", str(G), "--sampler.max_tokens", "48",
        "--sampler.num_slots", "4", "--sampler.decode_lanes", "1",
        "--sampler.decode_steps_per_call", "1", "--sampler.kv_cache", "paged",
        "--sampler.page_size", "8", "--learner.seq_buckets", "64",
        "--metrics.samples_every", "1", "--metrics.num_samples", str(GROUPS * G))
# case -> its config (configs/); multi-turn: episodes of up to 48 ids after the prompt
CONFIGS = {"single-turn": "demo.py", "multi-turn": "multiturn_demo.py"}
# case -> what each launch kills ("sampler": a replica, then the launch runs to the end;
# None: nothing). The learner's and the launcher's kills go to the multi-turn case, the one
# whose journal holds the most (episodes, environment ids, parked turns); the single-turn
# case shows the sampler's.
VICTIMS = {"single-turn": ("sampler",),
           "multi-turn": ("sampler and learner", "launcher", None)}
JOURNAL = ("--sampler.journal_every_steps", str(EVERY))
RESUMED = r"prompt_id \d+ \(stream_index \d+\): (\d+) samples resumed from the journal"


@pytest.fixture(params=sorted(CONFIGS))
def case(request):
    return request.param


def _start(env, run_dir, name, case, *overrides):
    return subprocess.Popen(demo_train_cmd(run_dir, name, *overrides, config=CONFIGS[case]),
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.fixture
def reference(env, tmp_path, case):   # noqa: F811 - the module fixture of test_runtime_e2e
    """The uninterrupted run's completions (``_completions``)."""
    ref = _start(env, tmp_path, "ref", case, *ARGS)
    _, err = _finish(ref)
    assert ref.returncode == 0, err[-3000:]
    return _completions(os.path.join(str(tmp_path), "ref"))


def _completions(run):
    """``{step: sorted [(prompt_id, version, completion ids)]}`` of every trained sample."""
    out = {}
    with open(os.path.join(run, "samples.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            out.setdefault(r["step"], []).append((r["prompt_id"], r["version"],
                                                   tuple(r["completion_ids"])))
    return {s: sorted(v) for s, v in out.items()}


def _samplers(run):
    pids = json.load(open(os.path.join(run, "processes.json")))
    return [pids[f"sampler-{i}"] for i in range(REPLICAS)]


def _newest_checkpoint(run):
    folder = os.path.join(run, "checkpoints")
    steps = [int(d) for d in os.listdir(folder) if d.isdigit()] if os.path.isdir(folder) else []
    return max(steps, default=-1)


def _mid_decode(run, replicas, version=None, episodes=False):
    """Whether the journal of one of ``replicas`` holds a sample in mid-decode (>= 2 tokens,
    not finished; all its sampled tokens of ``version`` when given; with ``episodes``, an
    episode past its first turn: environment ids, version -1, among them)."""
    for i in replicas:
        try:
            entries, _ = journal.decode(open(journal.journal_path(run, f"sampler-{i}"),
                                             "rb").read())
        except OSError:
            continue
        if any(e.finish_reason == "" and e.tokens.size >= 2 and
               (version is None or set(e.versions.tolist()) - {-1} == {version}) and
               (not episodes or -1 in e.versions) for e in entries):
            return True
    return False


def _learner_version(run):
    """The learner's version now: its newest step in metrics.jsonl (0 before the first)."""
    path = os.path.join(run, "metrics.jsonl")
    steps = [json.loads(x)["step"] for x in open(path) if x.strip().endswith("}")] \
        if os.path.isfile(path) else []
    return max(steps, default=0)


def _aim(run, proc, kill, replicas=range(REPLICAS), checkpointed=False, episodes=False):
    """Freeze the replicas until the journals of ``replicas`` hold a sample in mid-decode
    with the learner's current version (with ``checkpointed``: once the learner's
    checkpoint of that version is written, waited for frozen), then ``kill()`` and let them
    go on."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        assert time.monotonic() < deadline and proc.poll() is None
        pids = _samplers(run)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            version = _learner_version(run)
            if _mid_decode(run, replicas, version, episodes):
                saved = time.monotonic() + 20     # (runtime.replica_timeout_s: 60)
                while checkpointed and _newest_checkpoint(run) < version and \
                        time.monotonic() < saved and proc.poll() is None:
                    time.sleep(0.05)
                if not checkpointed or _newest_checkpoint(run) == version:
                    kill()
                    return
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)


def _resumed(run):
    """Samples resumed from the journal, per replica log line, over every launch."""
    return sum(int(n) for i in range(REPLICAS) for n in re.findall(
        RESUMED, open(os.path.join(run, "logs", f"sampler-{i}.log")).read()))


def _check_against_reference(run, want, case):
    got = _completions(run)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert len(got[step]) == GROUPS * G
        assert got[step] == want[step], f"step {step}: completions differ"
    # nothing trained twice, nothing lost: each step once, the stream's first prompts once
    recs = read_trained_prompts(run)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert sorted(i for r in recs for i in r["stream_index"]) == list(range(STEPS * GROUPS))
    last = _steps(run)[STEPS]
    assert last["sampler/journal_damaged"] == 0 and last["sampler/journal_dropped_stale"] == 0
    assert 1 <= last["sampler/journal_lag_max"] <= EVERY, last
    if case == "multi-turn":      # environments rebuilt by replaying turns, all alike
        assert last["sampler/episodes_replay_mismatch"] == 0, last
        assert any(s.get("sampler/episodes_resumed") for s in _steps(run).values())
    assert sum(len(c) for s in got for _, _, c in got[s]) > 2 * len(got) * GROUPS * G


def _wait_for_resumed(run, proc, more_than):
    """Until the replicas' logs count more than ``more_than`` samples resumed."""
    deadline = time.monotonic() + HANG_GUARD_S
    while _resumed(run) <= more_than:
        assert time.monotonic() < deadline, f"no sample resumed from the journal ({more_than})"
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)


def test_killed_sampler_learner_and_launcher_resume_from_the_journal(env, tmp_path, case,
                                                                     reference):
    """Launch 1: sampler-1 killed (-9) and restarted (``runtime.restart_sampler``): its
    prompts are leased again and resumed from its journal (single-turn: the launch then
    runs to the end); then the learner killed (-9, checkpoints every step): the run stops.
    Launch 2 resumes from the newest checkpoint and the replicas from the journals; the
    launcher is killed (-9): its programs stop (the learner saves its exit checkpoint).
    Launch 3 resumes and finishes."""
    run = os.path.join(str(tmp_path), "killed")
    args = (*ARGS, *JOURNAL, "--checkpoint.every_steps", "1", "--runtime.restart_sampler",
            "True")
    resumed = []
    for victim in VICTIMS[case]:
        # a step of this launch first (the journals on disk are then this launch's)
        at_step = 1 if not resumed else _newest_checkpoint(run) + 1
        assert at_step < STEPS, "the learner was killed too late to kill the launcher after"
        proc = _start(env, tmp_path, "killed", case, *args)
        aim = functools.partial(_aim, episodes=case == "multi-turn")
        try:
            if victim is None:
                _, err = _finish(proc)
                assert proc.returncode == 0, err[-3000:]
                break
            _wait_for_step(run, at_step, proc)
            if victim == "launcher":
                pids = list(json.load(open(os.path.join(run, "processes.json"))).values())
                aim(run, proc, proc.kill)
                _finish(proc)
                deadline = time.monotonic() + HANG_GUARD_S
                while any(_alive(p) for p in pids):
                    assert time.monotonic() < deadline, "the launcher's programs live on"
                    time.sleep(0.1)
            else:
                aim(run, proc, lambda: os.kill(_samplers(run)[1], signal.SIGKILL),
                     replicas=[1])
                _wait_for_resumed(run, proc, 0)        # the restarted replica resumed
                if victim == "sampler":
                    _, err = _finish(proc)
                    assert "the sampler-1 process died (killed by SIGKILL); restarting it" \
                        in err
                    assert proc.returncode == 0, err[-3000:]
                    resumed.append(_resumed(run))
                    break
                pid = json.load(open(os.path.join(run, "processes.json")))["learner"]
                aim(run, proc, lambda: os.kill(pid, signal.SIGKILL), checkpointed=True)
                _, err = _finish(proc)
                assert "the sampler-1 process died (killed by SIGKILL); restarting it" in err
                assert proc.returncode == 1 and "the learner process died (killed by " \
                    "SIGKILL)" in err, err[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
        resumed.append(_resumed(run))
    learner_log = open(os.path.join(run, "logs", "learner.log")).read()
    launches = len(VICTIMS[case])
    assert len(re.findall(r"resumed from checkpoint step \d+", learner_log)) == launches - 1
    got = _resumed(run)
    # each launch resumed samples from the journals, more than the launches before it
    counts = resumed + [got] if launches > 1 else resumed
    assert counts[0] >= 1 and all(a < b for a, b in zip(counts, counts[1:])), (resumed, got)
    _check_against_reference(run, reference, case)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
