"""Issue 44 item 3 acceptance on a real run: `rlflow train` (the demo config, 2 steps) scores
every sample through a reward server on 127.0.0.1 started by the test (:mod:`reward_server`)
that answers the demo's own reward (``digits_match``), fails its first request with a 500
and holds its third one for good. The run finishes; every logged sample's reward is the
server's score for that sample; the retries and the timed-out try are counted in
metrics.jsonl; no sample is marked failed (each failure was retried to success).
"""

import os
import shutil
import subprocess
import sys

import pytest

from rlflow.data.tasks import digits_match
from rlflow.run.folder import metrics_by_step, read_jsonl
from reward_server import HANG, RewardServer, scores_reply

pytestmark = pytest.mark.slow

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HANG_GUARD_S = 300
NUM_STEPS = 2


def _score(item):
    return digits_match(item["completion"], item["answer"], finish_reason=item["finish_reason"])


def test_a_run_scores_through_a_local_reward_server(tmp_path):
    def respond(n, path, body, headers):
        if n == 0:
            return 500, "warming up"
        if n == 2:
            return HANG
        return scores_reply(body, _score)

    env = dict(os.environ)              # the session's demo model folder (tests/e2e_runs.py)
    exe = shutil.which("rlflow", path=os.path.dirname(sys.executable))
    with RewardServer(respond) as server:
        cmd = ([exe] if exe else [sys.executable, "-m", "rlflow.console.cli"]) + [
            "train", "--config", os.path.join(REPO, "configs", "demo.py"),
            "--metrics.report", "False",
            "--run-dir", str(tmp_path / "runs"), "--name", "served",
            "--metrics.progress", "plain", "--buffer.timeout-s", "120",
            "--checkpoint.every-steps", "0", "--learner.num-steps", str(NUM_STEPS),
            "--metrics.samples-every", "1", "--metrics.num-samples", "64",
            "--reward.functions", "http", "--reward.weights", "1.0",
            "--reward.http.url", server.url + "/score",
            "--reward.http.fields", "prompt", "completion", "answer", "finish_reason",
            "sample_id",
            "--reward.http.timeout-s", "2", "--reward.http.backoff-s", "0.01",
            "--reward.http.max-backoff-s", "0.05"]
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = os.path.join(str(tmp_path / "runs"), "served")

    # what the server scored: (prompt_id, completion, truncated) -> score
    served = {}
    for _, body, _ in server.requests:
        assert isinstance(body, dict) and len(body["samples"]) == 8   # one group per request
        for item in body["samples"]:
            assert item["prompt"].endswith(">") and item["answer"].isdigit()
            prompt_id = int(item["sample_id"].split()[1])
            served[(prompt_id, item["completion"], item["finish_reason"] == "length")] = \
                _score(item)
    samples, problems = read_jsonl(os.path.join(run, "samples.jsonl"))
    assert not problems, problems
    assert {s["step"] for s in samples} == set(range(1, NUM_STEPS + 1))
    for s in samples:
        key = (s["prompt_id"], s["completion"], s["truncated"])
        assert key in served, (key, sorted(served)[:20])
        assert s["reward"] == pytest.approx(served[key], abs=1e-6), (s, served[key])
        assert not s.get("failed", False), s

    records, problems = read_jsonl(os.path.join(run, "metrics.jsonl"))
    assert not problems
    by_step = metrics_by_step(records)
    assert sorted(by_step) == list(range(1, NUM_STEPS + 1))
    count = {k: max(m.get(k, 0.0) for m in by_step.values())
             for k in ("reward/http_retries/http", "reward/http_timeouts/http",
                       "reward/http_errors/http", "reward/http_requests/http")}
    assert count["reward/http_retries/http"] >= 2, count    # after the 500 and the hang
    assert count["reward/http_timeouts/http"] >= 1 and count["reward/http_errors/http"] >= 1, \
        count
    assert count["reward/http_requests/http"] >= 2 * NUM_STEPS, count


def test_a_key_echoed_by_a_401_reaches_no_log_stderr_or_failure_line(tmp_path):
    """Issue 49 fault 2 on a real run: the key comes from the environment with an editor's
    trailing CR/LF (stripped: the server receives the bare key), the server answers 401 with
    the key echoed; the sampler stops after reward.max_consecutive_errors. Neither the run
    folder (program logs, metrics, samples) nor the launcher's stdout/stderr (its failure
    line) holds the key in any spelling. The echo is padded so the 200-character cut of the
    quoted body falls 12 characters into the key (a new user's report: the part before the
    cut stayed visible)."""
    key = "sk-live-9b8e7d6c5a4f"
    seen = []

    def respond(n, path, body, headers):
        auth = {k.lower(): v for k, v in headers.items()}.get("authorization", "")
        seen.append(auth)
        return 401, "E" * (200 - len("Bearer ") - 12) + f"{auth} ({auth[7:]})"

    env = dict(os.environ, RM_KEY=key + "\r\n")     # the session's demo model folder
    exe = shutil.which("rlflow", path=os.path.dirname(sys.executable))
    with RewardServer(respond) as server:
        cmd = ([exe] if exe else [sys.executable, "-m", "rlflow.console.cli"]) + [
            "train", "--config", os.path.join(REPO, "configs", "demo.py"),
            "--metrics.report", "False",
            "--run-dir", str(tmp_path / "runs"), "--name", "leak",
            "--metrics.progress", "plain", "--buffer.timeout-s", "120",
            "--checkpoint.every-steps", "0", "--learner.num-steps", "2",
            "--reward.functions", "http", "--reward.weights", "1.0",
            "--reward.max-consecutive-errors", "2",
            "--reward.http.url", server.url + "/score", "--reward.http.api-key-env", "RM_KEY",
            "--reward.http.max-retries", "0"]
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=HANG_GUARD_S)
    assert proc.returncode != 0 and seen and set(seen) == {"Bearer " + key}, proc.stderr[-3000:]
    assert "rlflow train: the sampler failed" in proc.stderr, proc.stderr[-3000:]
    assert "<redacted>" in proc.stderr, proc.stderr[-3000:]   # the reason is shown, hidden
    texts = {"stdout": proc.stdout, "stderr": proc.stderr}
    for d, _, names in os.walk(tmp_path / "runs"):
        for name in names:
            with open(os.path.join(d, name), "rb") as f:
                texts[os.path.join(d, name)] = f.read().decode("utf-8", "replace")
    assert any(name.endswith(".log") for name in texts), sorted(texts)
    for where, text in texts.items():
        assert "sk-live" not in text, (where, text[-2000:])
