"""Issue 53, acceptance: the sampler is killed (-9) in the middle of its generations and
restarted; with the journal of partial generations it resumes them, and every completion
trained equals, token for token, that of an uninterrupted sync-mode run with the same seeds
(real processes; the demo's tiny model on CPU, long completions, small decode calls)."""

import json
import os
import signal

import numpy as np
import pytest

from rlflow.run import journal
from test_replicas_e2e import _finish
from test_runtime_e2e import HANG_GUARD_S, _start, _steps, _wait_for_step, env  # noqa: F401

pytestmark = pytest.mark.slow

STEPS, GROUPS, G = 3, 4, 4
ARGS = ("--runtime.mode", "sync", "--runtime.max_staleness", "0",
        "--learner.num_steps", str(STEPS), "--learner.groups_per_step", str(GROUPS),
        "--sampler.group_size", str(G), "--sampler.max_tokens", "48",
        "--sampler.num_slots", "4", "--sampler.decode_lanes", "1",
        "--sampler.decode_steps_per_call", "1", "--sampler.kv_cache", "paged",
        "--sampler.page_size", "8", "--learner.seq_buckets", "64",
        "--metrics.samples_every", "1",
        "--metrics.num_samples", str(GROUPS * G))


def _completions(run):
    """``{step: sorted [(prompt_id, version, completion ids)]}`` of every trained sample."""
    out = {}
    with open(os.path.join(run, "samples.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            out.setdefault(r["step"], []).append((r["prompt_id"], r["version"],
                                                   tuple(r["completion_ids"])))
    return {s: sorted(v) for s, v in out.items()}


def _journal_in_flight(run):
    """Whether sampler-0's journal holds a sample decoding (tokens, not finished)."""
    try:
        entries, _ = journal.decode(open(journal.journal_path(run, "sampler-0"), "rb").read())
    except OSError:
        return False
    return any(e.finish_reason == "" and e.tokens.size >= 2 for e in entries)


@pytest.mark.xfail(strict=False, reason=(
    "issue 53, open: a restarted replica does not always find its journaled samples again "
    "(an entry can carry another lease than the prompt re-leased to it, so the resume is "
    "missed and the tokens are generated again; seen under load in the full suite)"))
def test_killed_sampler_resumes_its_partial_generations(env, tmp_path):
    import time

    ref = _start(env, tmp_path, "ref", *ARGS)
    _, err = _finish(ref)
    assert ref.returncode == 0, err[-3000:]

    proc = _start(env, tmp_path, "killed", *ARGS, "--sampler.journal_every_steps", "1",
                  "--runtime.restart_sampler", "True")
    run = os.path.join(str(tmp_path), "killed")
    try:
        _wait_for_step(run, 1, proc)
        deadline = time.monotonic() + HANG_GUARD_S
        while not _journal_in_flight(run):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.002)
        os.kill(json.load(open(os.path.join(run, "processes.json")))["sampler"],
                signal.SIGKILL)
        _, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "process died (killed by SIGKILL); restarting it" in err
    last = _steps(run)[STEPS]
    assert last["sampler/journal_resumed_samples"] >= 1, last
    assert last["sampler/journal_resumed_tokens"] >= 2
    assert last["sampler/journal_damaged"] == 0 and last["sampler/journal_dropped_stale"] == 0
    got, want = _completions(run), _completions(os.path.join(str(tmp_path), "ref"))
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert len(got[step]) == GROUPS * G
        assert got[step] == want[step], f"step {step}: completions differ"
    # nothing trained twice: every step trained GROUPS distinct prompts' groups
    assert all(len({p for p, _, _ in got[s]}) == GROUPS for s in got)
    assert np.mean([len(c) for s in got for _, _, c in got[s]]) > 2   # long enough to cut
