"""Issue 8 acceptance on a real run: one short ``rlflow train`` (demo config, 10 steps,
samples every 2 steps, a ring-buffer token in ``RLFLOW_BUFFER_TOKEN``) as a subprocess with
stdout/stderr to files (not a TTY), then

* no file of the run folder, no output line and no argv of the launcher or of a process
  it started holds the token (issue 18.2);

* its terminal output holds no control characters (no ANSI colours, no carriage returns);
* the run folder (``rlflow.run.folder.validate_run_folder``: config, every required metric,
  a TensorBoard file, samples) and, beyond what that checks: every metric value finite in
  every record, the TensorBoard file read back by TensorBoard's ``EventAccumulator`` with
  every required metric as a scalar tag, and sample completions with their fields;
* ``rlflow report <run>`` (subprocess) writes the page and the PNGs; each PNG is opened
  with PIL and checked for size and for not being blank;

* the run is asynchronous (``max_staleness`` 2): every step trains within the staleness
  bound and never on a version newer than the learner's, the sampler swaps weights mid-run,
  and summary.json records the completed run.
"""

import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from rlflow.run.metrics import REQUIRED_METRICS, RESERVED_KEYS
from rlflow.run.folder import metrics_by_step, read_jsonl, validate_run_folder
from rlflow.config.secrets import ENV_BUFFER_TOKEN, REDACTED
from tolerances import F32_EPS

pytestmark = pytest.mark.slow

from test_phases import no_torch_env

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HANG_GUARD_S = 300
TOKEN = "tok-9f3e71c2-not-for-files"
NUM_STEPS, SAMPLES_EVERY, STALENESS = 10, 2, 2
PLOTS = ("reward", "length", "kl_entropy", "throughput", "staleness", "perf", "timing",
         "mismatch", "rollout_correction",  # every train step logs the mismatch diagnostics
         "replicas", "ledger",          # these two: every run has a replica and a ledger
         "weight_pause")                # the sampler swapped weights mid-run
# C0 controls except tab and newline (so: ESC of ANSI codes, carriage return, backspace ...),
# DEL and the C1 controls.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _rlflow():
    exe = shutil.which("rlflow", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "rlflow.console.cli"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run-outputs")
    env = no_torch_env(root / "site")       # as installed without torch: no advisory printed
    # the demo model folder: the session's (conftest's RLFLOW_CACHE_DIR, tests/e2e_runs.py)
    env["TERM"] = "xterm-256color"          # only the missing TTY may make the output plain
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        env.pop(name, None)
    cmd = _rlflow() + ["train", "--config", os.path.join(REPO, "configs", "demo.py"),
                       "--metrics.report", "False",
                       "--run-dir", str(root / "runs"), "--name", "outputs",
                       "--learner.num-steps", str(NUM_STEPS),
                       "--metrics.samples-every", str(SAMPLES_EVERY),
                       "--runtime.max-staleness", str(STALENESS),
                       "--checkpoint.every-steps", "0", "--buffer.timeout-s", "120"]
    env[ENV_BUFFER_TOKEN] = TOKEN           # issue 18.2: the run's secret, by environment
    with open(root / "out", "wb") as out, open(root / "err", "wb") as err:
        child = subprocess.Popen(cmd, env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=err)
        argvs = _watch_argv(child)
    proc = subprocess.CompletedProcess(cmd, child.returncode, (root / "out").read_bytes(),
                                       (root / "err").read_bytes())
    proc.argvs = argvs
    return proc, str(root / "runs" / "outputs"), env


def _descendants(pid):
    """Pids of ``pid``'s live descendants (from /proc/<pid>/stat parent ids)."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _watch_argv(child):
    """Until ``child`` exits: the argv of it and of every process it started (a set of
    NUL-joined byte strings), sampled every 0.1 s."""
    import time

    seen = set()
    deadline = time.monotonic() + HANG_GUARD_S
    while child.poll() is None:
        if time.monotonic() > deadline:
            child.kill()
            child.wait()
            raise AssertionError("rlflow train did not finish")
        for pid in {child.pid} | _descendants(child.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    seen.add(f.read())
            except OSError:
                pass
        time.sleep(0.1)
    return seen


def _ok(proc):
    assert proc.returncode == 0, proc.stderr.decode("utf-8", "replace")[-4000:]


def test_non_tty_output_has_no_control_characters(run):
    proc = run[0]
    _ok(proc)
    for name, raw in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        text = raw.decode("utf-8")                      # also: valid UTF-8
        bad = sorted({hex(ord(c)) for c in CONTROL.findall(text)})
        assert not bad, f"{name} holds control characters {bad}: {text[-1500:]!r}"
    out = (proc.stdout + proc.stderr).decode("utf-8")
    assert f"step {NUM_STEPS}/{NUM_STEPS}" in out       # the plain progress lines are there


def test_start_up_phases_are_printed_and_no_torch_advisory(run):
    """Issue 49, fault 9: before step 1 the console says what the programs are doing
    (from the phase lines of their logs), and transformers' "PyTorch was not found" advisory
    is printed nowhere, though this run's Python cannot import torch."""
    proc, run_dir, _ = run
    _ok(proc)
    out = (proc.stdout + proc.stderr).decode("utf-8")
    before = out[:out.index("step 1/")]
    sampler = "sampler"                     # one replica: logs/sampler.log (named by its log)
    assert os.path.isfile(os.path.join(run_dir, "logs", f"{sampler}.log"))
    for phase in ("[learner] loading the model", "[learner] waiting for the first rollouts",
                  f"[{sampler}] loading the model",
                  f"[{sampler}] waiting for the learner's first weights"):
        assert f"rlflow train: {phase}" in before, before
    # the last phase before step 1 is reported when the first groups are in; printed unless
    # step 1 was logged within the same poll (so it is looked for in the learner's log)
    with open(os.path.join(run_dir, "logs", "learner.log"), encoding="utf-8") as f:
        assert "rlflow.phase: compiling the train step" in f.read()
    logs = "".join(open(os.path.join(run_dir, "logs", n), encoding="utf-8").read()
                   for n in os.listdir(os.path.join(run_dir, "logs")))
    assert "PyTorch was not found" not in out + logs


def test_token_is_in_no_file_of_the_run_folder_and_in_no_argv(run):
    proc, run_dir, _ = run
    _ok(proc)
    files = [os.path.join(d, f) for d, _, names in os.walk(run_dir) for f in names]
    assert any(f.endswith(os.sep + "config.json") for f in files)
    assert any(os.sep + "checkpoints" + os.sep in f for f in files)     # the exit checkpoint
    leaks = []
    for path in files:
        with open(path, "rb") as f:
            if TOKEN.encode() in f.read():
                leaks.append(os.path.relpath(path, run_dir))
    assert not leaks, f"the token is stored in {leaks}"
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["buffer"]["token"] == REDACTED
    assert TOKEN.encode() not in proc.stdout + proc.stderr
    # the launcher and both programs were seen, and no argv held the token
    argvs = proc.argvs
    assert any(b"--role\0learner" in a for a in argvs), sorted(argvs)[:5]
    assert any(b"--role\0sampler" in a for a in argvs)
    assert not [a for a in argvs if TOKEN.encode() in a]


def test_run_folder_config_metrics_tensorboard_samples(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc, run_dir, _ = run
    _ok(proc)
    validate_run_folder(run_dir)         # config.json parses, every required metric logged,
    #                                      no record flagged non-finite, a TB file, samples
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert config["learner"]["num_steps"] == NUM_STEPS            # the resolved config
    assert config["metrics"]["samples_every"] == SAMPLES_EVERY

    records, problems = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert not problems, problems
    assert {r["step"] for r in records} == set(range(1, NUM_STEPS + 1))
    for r in records:                    # every logged value is a finite number
        for k, v in r.items():
            if k not in RESERVED_KEYS:
                assert isinstance(v, (int, float)) and math.isfinite(v), (r["step"], k, v)
    logged = set().union(*(r.keys() for r in records))
    assert not [n for n in REQUIRED_METRICS if n not in logged]

    events = glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    missing = [n for n in REQUIRED_METRICS if n not in tags]
    assert not missing, f"TensorBoard scalars missing {missing}"
    reward = acc.Scalars("reward/mean")
    assert sorted({e.step for e in reward}) == list(range(1, NUM_STEPS + 1))
    want = {r["step"]: r["reward/mean"] for r in records if "reward/mean" in r}
    for e in reward:                     # the TB values are the JSONL values (float32)
        # one float32 rounding (TensorBoard stores float32) of the JSONL value
        assert np.isclose(e.value, want[e.step], rtol=F32_EPS, atol=0), (e.step, e.value)

    samples, problems = read_jsonl(os.path.join(run_dir, "samples.jsonl"))
    assert not problems, problems
    assert {s["step"] for s in samples} == set(range(SAMPLES_EVERY, NUM_STEPS + 1,
                                                     SAMPLES_EVERY))
    for s in samples:
        assert isinstance(s["prompt"], str) and s["prompt"]
        assert isinstance(s["completion"], str)
        assert isinstance(s["reward"], float) and math.isfinite(s["reward"])
        assert isinstance(s["version"], int) and 0 <= s["version"] < s["step"]


def test_report_writes_page_and_non_blank_pngs(run):
    proc, run_dir, env = run
    _ok(proc)
    rep = subprocess.run(_rlflow() + ["report", run_dir], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert rep.returncode == 0, rep.stderr[-3000:]
    page = rep.stdout.strip().splitlines()[-1]
    assert page == os.path.join(run_dir, "report", "report.html") and os.path.isfile(page)
    html = open(page, encoding="utf-8").read()
    assert html.count("data:image/png;base64,") == len(PLOTS)
    md = open(os.path.join(run_dir, "report", "report.md"), encoding="utf-8").read()
    for name in PLOTS:
        assert f"plots/{name}.png" in md
        path = os.path.join(run_dir, "report", "plots", f"{name}.png")
        with Image.open(path) as im:
            assert im.format == "PNG"
            rgb = np.asarray(im.convert("RGB"), dtype=np.float64)
        height, width, _ = rgb.shape
        assert width >= 640 and height >= 400, (name, width, height)
        # Not blank: many pixels differ from the most common (background) colour.
        flat = rgb.reshape(-1, 3)
        colours, counts = np.unique(flat, axis=0, return_counts=True)
        background = colours[counts.argmax()]
        drawn = (np.abs(flat - background).max(axis=-1) > 30).mean()
        assert drawn > 0.01, f"{name}: only {drawn:.4f} of the pixels differ from background"
        assert len(colours) > 20, f"{name}: {len(colours)} colours"


def _non_decreasing(xs):
    return all(b >= a for a, b in zip(xs, xs[1:]))


def test_async_run_completes_within_staleness_bound(run):
    proc, run_dir, _ = run
    _ok(proc)
    records, problems = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert not problems, problems
    by_step = metrics_by_step(records)
    assert sorted(by_step) == list(range(1, NUM_STEPS + 1))
    assert [m["learner/version"] for m in by_step.values()] == list(range(1, NUM_STEPS + 1))
    for step, m in by_step.items():
        assert m["staleness/max"] <= STALENESS, (step, m["staleness/max"])
        assert m["learner/version"] - 1 - m["rollout/version_min"] <= STALENESS
        assert m["rollout/version_max"] <= step - 1          # never newer than the learner
    sampler_versions = [m["sampler/version"] for m in by_step.values() if "sampler/version" in m]
    assert sampler_versions and _non_decreasing(sampler_versions)
    assert _non_decreasing([m["rollout/version_max"] for m in by_step.values()])
    used = {int(m[k]) for m in by_step.values() for k in ("rollout/version_min",
                                                          "rollout/version_max")}
    assert len(used) >= 2, used                     # the sampler swapped weights mid-run
    # issue 53.3: the pause per version, in parts that sum to it, beside the transfer time
    pauses = [m for m in by_step.values() if "sampler/weight_pause_s" in m]
    assert pauses, "no step logged sampler/weight_pause_s"
    parts = [f"sampler/weight_pause_{p}_s" for p in ("pull", "cast", "install")]
    for m in pauses:
        assert all(m[k] >= 0.0 for k in parts + ["sampler/weight_transfer_s"]), m
        assert m["sampler/weight_pause_s"] == pytest.approx(sum(m[k] for k in parts),
                                                            rel=4 * F32_EPS, abs=1e-9)
        assert m["sync/sampler_pause_s"] == m["sampler/weight_pause_s"]
        assert 0 <= m["sampler/weight_pause_version"] <= m["learner/version"]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["steps_completed"] == NUM_STEPS and summary["success"]
