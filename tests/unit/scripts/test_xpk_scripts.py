"""GKE / xpk scripts (scripts/xpk/): shellcheck, --dry-run commands with multi-host TPU types
(per-host lines), pod_run.sh's slice environment from the GKE TPU variables; and the
multi-host slice types of scripts/tpu/start.sh."""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess

import pytest

from tpu_slices import fit

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
XPK = os.path.join(REPO, "scripts", "xpk")
TPU = os.path.join(REPO, "scripts", "tpu")
SHELLCHECK = os.path.join(REPO, ".venv", "bin", "shellcheck")
BASE = ["--cluster", "c7", "--zone", "us-east5-a", "--project", "my-proj", "--name", "exp7"]
HOST_LINE = re.compile(r"^# (learner|sampler) host (\d+) of (\d+) \(([-a-z0-9]+)\): (.*)$")


def dry(path, *args, ok=True, token="s3cret-env"):
    env = {k: v for k, v in os.environ.items() if k != "RLFLOW_BUFFER_TOKEN"}
    env["RLFLOW_BUFFER_TOKEN"] = token
    proc = subprocess.run(["bash", path, "--dry-run", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=env)
    if ok:
        assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    cmds = [shlex.split(ln) for ln in lines if not ln.startswith("#")]
    hosts = [HOST_LINE.match(ln).groups() for ln in lines if HOST_LINE.match(ln)]
    return cmds, hosts, proc


def flag(cmd, name):
    vals = [w.split("=", 1)[1] for w in cmd if w.startswith(name + "=")]
    assert len(vals) == 1, (name, cmd)
    return vals[0]


@pytest.mark.parametrize("script", sorted(glob.glob(os.path.join(XPK, "*.sh"))),
                         ids=os.path.basename)
def test_shellcheck_clean(script):
    proc = subprocess.run([SHELLCHECK, "-x", script], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = open(script).read()
    assert text.startswith("#!/usr/bin/env bash")
    if not script.endswith("common.sh"):
        assert "set -euo pipefail" in text


def per_host(hosts, role):
    """{host index: dict of the RLFLOW_ variables} of one role's per-host lines."""
    out = {}
    for r, i, n, typ, rest in hosts:
        if r == role:
            out[int(i)] = dict(w.split("=", 1) for w in rest.split() if w.startswith("RLFLOW_"))
            out[int(i)]["_of"], out[int(i)]["_type"] = int(n), typ
    return out


def test_xpk_start_creates_one_workload_per_program_with_per_host_lines():
    cmds, hosts, _ = dry(os.path.join(XPK, "start.sh"), *BASE, "--docker-image", "gcr.io/p/r:1",
                         "--learner-type", "v5p-16", "--sampler-type", "v6e-16",
                         "--run-dir", "gs://bkt/runs", "--model-dir",
                         "/models/q", "--", *fit("v5p-16", "v6e-16"), "--learner.lr", "1e-6")
    assert [c[:3] for c in cmds] == [["xpk", "workload", "create"]] * 2
    learner_addr = "exp7-learner-slice-job-0-0.exp7-learner"
    for cmd, role, typ in zip(cmds, ("learner", "sampler"), ("v5p-16", "v6e-16")):
        assert flag(cmd, "--workload") == f"exp7-{role}" and flag(cmd, "--tpu-type") == typ
        assert flag(cmd, "--cluster") == "c7" and flag(cmd, "--zone") == "us-east5-a"
        assert flag(cmd, "--project") == "my-proj" and flag(cmd, "--num-slices") == "1"
        assert flag(cmd, "--docker-image") == "gcr.io/p/r:1"
        words = shlex.split(flag(cmd, "--command"))
        env = dict(w.split("=", 1) for w in words[1:words.index("bash")])
        assert env == {"RLFLOW_BUFFER_ADDRESS": f"{learner_addr}:5555",
                       "RLFLOW_COORDINATOR_ADDRESS": f"{learner_addr}:5556",
                       "RLFLOW_JAX_PORT": "8476", "RLFLOW_MODEL_PATH": "/models/q"}
        rest = words[words.index("bash") + 1:]
        assert rest[:2] == ["scripts/xpk/pod_run.sh", role]
        assert rest[rest.index("--run_dir") + 1] == "gs://bkt/runs"
        assert rest[rest.index("--learner.num_hosts") + 1] == "2"     # v5p-16: 2 hosts
        assert rest[-2:] == ["--learner.lr", "1e-6"]
        assert not any("s3cret" in w or "token" in w for w in cmd)   # the token: no argv
        assert os.path.basename(flag(cmd, "--env-file")).startswith("tmp")
    # v5p-16 = 2 hosts x 4 chips: one multi-controller learner program over both hosts
    lines = per_host(hosts, "learner")
    assert sorted(lines) == [0, 1]
    for i, env in lines.items():
        assert env["RLFLOW_PROCESS_ID"] == str(i) and env["RLFLOW_NUM_PROCESSES"] == "2"
        assert env["RLFLOW_JAX_COORDINATOR"] == \
            "exp7-learner-slice-job-0-0.exp7-learner:8476" and env["_of"] == 2
    # v6e-16 = 4 hosts x 4 chips: each sampler host is one replica, its own JAX program
    lines = per_host(hosts, "sampler")
    assert sorted(lines) == [0, 1, 2, 3]
    for i, env in lines.items():
        assert env["RLFLOW_REPLICA"] == str(i) and env["_of"] == 4
        assert env["RLFLOW_PROCESS_ID"] == "0" and env["RLFLOW_NUM_PROCESSES"] == "1"
        assert "RLFLOW_JAX_COORDINATOR" not in env


def test_xpk_delete_and_named_errors():
    cmds, _, _ = dry(os.path.join(XPK, "delete.sh"), *BASE, "--role", "learner")
    assert cmds == [["xpk", "workload", "delete", "--cluster=c7", "--zone=us-east5-a",
                     "--project=my-proj", "--workload=exp7-learner"]]
    start = os.path.join(XPK, "start.sh")
    for args, message in (
            (["--zone", "z"], "--cluster is required"),
            (["--zone", "z", "--cluster", "c"], "--docker-image is required"),
            (["--zone", "z", "--cluster", "c", "--docker-image", "i", "--learner-type",
              "v5p-16"], "--run-dir must be shared storage (gs://...) when the learner slice "
                         "(v5p-16) has 2 hosts"),
            (["--zone", "z", "--cluster", "c", "--docker-image", "i", "--learner-type",
              "v7x-12"], "unknown accelerator type v7x-12"),
            (["--zone", "z", "--cluster", "--docker-image", "i"], "--cluster needs a value"),
            # issue 39 fault 6: the slices against the config, before any workload
            (["--zone", "z", "--cluster", "c", "--docker-image", "i", "--learner-type",
              "v5p-32", "--run-dir", "gs://b/r"], "the learner slice v5p-32 has 16 chips "
                                                   "(4 host(s) x 4) but the config has "
                                                   "learner.num_devices=8"),
            (["--zone", "z", "--cluster", "c", "--docker-image", "i", "--sampler-type",
              "v6e-16"], "each sampler host of v6e-16 (one replica per host) has 4 chips but "
                         "the config has sampler.num_devices=8")):
        _, _, proc = dry(start, *args, ok=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def pod_env(tmp_path, worker_id, hostnames, *extra, token=""):
    env = {"PATH": os.environ["PATH"], "RLFLOW_BUFFER_ADDRESS": "l0:5555", "TMPDIR": str(tmp_path),
           "RLFLOW_BUFFER_TOKEN": token,
           "RLFLOW_COORDINATOR_ADDRESS": "l0:5556", "TPU_WORKER_ID": worker_id,
           "TPU_WORKER_HOSTNAMES": hostnames, "RLFLOW_JAX_PORT": "9000"}
    return subprocess.run(["bash", os.path.join(XPK, "pod_run.sh"), *extra],
                          capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)


def test_pod_run_takes_its_slice_place_from_the_gke_tpu_environment(tmp_path):
    proc = pod_env(tmp_path, "2", "h0.x,h1.x,h2.x,h3.x", "--print-env", "sampler", "--x", "1",
                   token="tok-9f")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "tok-9f" not in proc.stdout                          # moved out of the environment
    token_file = tmp_path / "rlflow-buffer.token"
    assert token_file.read_text() == "tok-9f\n"
    assert oct(token_file.stat().st_mode & 0o777) == oct(0o600)
    assert lines[-1] == f"ARGS --x 1 --buffer.token_file {token_file}"
    env = dict(ln.split("=", 1) for ln in lines[:-1])
    # a sampler host is one replica (worker 2 of slice 0), not a part of a slice-wide program
    assert env["RLFLOW_REPLICA"] == "2" and env["RLFLOW_ROLE"] == "sampler"
    assert env["RLFLOW_PROCESS_ID"] == "0" and env["RLFLOW_NUM_PROCESSES"] == "1"
    assert "RLFLOW_JAX_COORDINATOR" not in env
    proc = pod_env(tmp_path, "1", "h0.x,h1.x", "--print-env", "learner")
    env = dict(ln.split("=", 1) for ln in proc.stdout.splitlines()[:-1])
    assert env["RLFLOW_PROCESS_ID"] == "1" and env["RLFLOW_NUM_PROCESSES"] == "2"
    assert env["RLFLOW_JAX_COORDINATOR"] == "h0.x:9000" and "RLFLOW_REPLICA" not in env
    proc = pod_env(tmp_path, "4", "h0,h1", "--print-env", "learner")
    assert proc.returncode == 2 and "TPU_WORKER_ID=4 is not an index" in proc.stderr
    proc = pod_env(tmp_path, "0", "h0", "--print-env", "trainer")
    assert proc.returncode == 2 and "ROLE must be learner or sampler" in proc.stderr


@pytest.mark.parametrize("typ,hosts", [("v5p-16", 2), ("v5p-32", 4), ("v5litepod-16", 4),
                                       ("v6e-16", 4), ("v6e-64", 16), ("v4-16", 2),
                                       ("v5litepod-8", 1), ("v6e-8", 1)])
def test_tpu_start_prints_each_host_of_a_multi_host_learner_slice(typ, hosts):
    cmds, lines, _ = dry(os.path.join(TPU, "start.sh"), "--zone", "z", "--name", "exp7",
                         "--learner-ip", "10.0.0.7", "--learner-type", typ,
                         "--run-dir", "gs://b/runs", "--", *fit(typ))
    ssh = [c for c in cmds if c[3:5] == ["tpu-vm", "ssh"]]
    assert [c[5] for c in ssh] == ["exp7-learner", "exp7-sampler"]
    assert flag(ssh[0], "--worker") == "all"                  # one ssh reaches every host
    remote = shlex.split(flag(ssh[0], "--command"))
    assert remote[remote.index("--learner.num_hosts") + 1] == str(hosts)   # one program
    learner = per_host(lines, "learner")
    assert sorted(learner) == list(range(hosts))
    assert all(e["RLFLOW_PROCESS_ID"] == str(i) and e["RLFLOW_NUM_PROCESSES"] == str(hosts)
               and e["_type"] == typ for i, e in learner.items())
    assert sorted(per_host(lines, "sampler")) == [0]          # v5litepod-8: one host


def test_tpu_start_needs_a_shared_run_dir_for_a_multi_host_learner():
    _, _, proc = dry(os.path.join(TPU, "start.sh"), "--zone", "z", "--learner-ip", "1.2.3.4",
                     "--learner-type", "v6e-16", ok=False)
    assert proc.returncode == 2
    assert "--run-dir must be shared storage (gs://...) when the learner slice (v6e-16) has " \
           "4 hosts" in proc.stderr
