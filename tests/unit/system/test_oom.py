"""A program killed by the OOM killer is reported as out of memory (rlflow.system.oom):
the cgroup's oom_kill counter (a fake memory.events here) and the program's peak resident
memory, read without root."""

import subprocess
import sys

from rlflow.system import oom
from rlflow.launcher import supervisor
from rlflow.control import programs_common as pc

EVENTS = "low 0\nhigh 0\nmax 12\noom 1\noom_kill {n}\noom_group_kill 0\n"       # cgroup v2
OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill {n}\n"                # cgroup v1

# allocates ~200 MB, says so, then waits for its end (the test SIGKILLs it)
ALLOCATES = ("import sys; b = bytearray(200 * 10 ** 6); b[::4096] = b'x' * len(b[::4096]); "
             "print('ready', flush=True); sys.stdin.read()")


def _sup(tmp_path, files):
    return supervisor.Supervisor(cfg=None, run_path=str(tmp_path), config_path="",
                                 endpoints=pc.Endpoints("127.0.0.1:1", "127.0.0.1:2"),
                                 oom=oom.OomWatch(files))


def _killed_child(tmp_path, sup, name="sampler"):
    """A child that allocated ~200 MB, sampled by the launcher, then SIGKILLed."""
    log = tmp_path / f"{name}.log"
    proc = subprocess.Popen([sys.executable, "-c", ALLOCATES], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    sup.children[name] = supervisor.Child(name, proc, str(log))
    sup.sample_memory()
    proc.kill()
    proc.wait()
    proc.stdout.close()
    proc.stdin.close()
    log.write_text("--- rlflow sampler start #0 ---\nloading\n")
    return proc


def test_a_sigkill_while_the_cgroups_oom_counter_rose_is_out_of_memory(tmp_path):
    events = tmp_path / "memory.events"
    events.write_text(EVENTS.format(n=3))
    sup = _sup(tmp_path, [str(events)])
    _killed_child(tmp_path, sup)
    events.write_text(EVENTS.format(n=4))            # the kernel killed one of the cgroup's
    report = sup.failure("sampler").splitlines()[0]
    assert report.startswith(
        "rlflow train: the sampler process died (killed by SIGKILL: out of memory (the "
        "kernel's OOM killer: this cgroup's oom_kill counter went from 3 to 4 during the run; "
        "its peak resident memory was 0.2 GB of this machine's ")
    peak = sup.oom.peaks[sup.children["sampler"].proc.pid]
    assert 200e6 <= peak < 400e6           # the child's 200 MB and the interpreter's own


def test_a_sigkill_the_counter_cannot_prove_is_possibly_out_of_memory(tmp_path):
    control = tmp_path / "memory.oom_control"
    control.write_text(OOM_CONTROL.format(n=0))
    sup = _sup(tmp_path, [str(tmp_path / "missing.events"), str(control)])
    _killed_child(tmp_path, sup)
    # a small program (0.2 GB resident) is not the OOM killer's likely victim: a plain kill
    assert sup.exit_text("sampler") == "killed by SIGKILL"
    # one that held a quarter of the machine or more may have been
    total = oom.machine_memory_bytes()
    sup.oom.peaks[sup.children["sampler"].proc.pid] = int(oom.LIKELY_VICTIM_FRACTION * total)
    assert sup.exit_text("sampler").startswith(
        "killed by SIGKILL (possibly out of memory: the kernel's OOM killer sends SIGKILL; "
        "this cgroup's oom_kill counter did not change; its peak resident memory was "
        f"{oom.LIKELY_VICTIM_FRACTION * total / 1e9:.1f} GB")
    unreadable = _sup(tmp_path, [str(tmp_path / "missing.events")])
    assert unreadable.oom.killed_text(-9) == (
        "killed by SIGKILL (possibly out of memory: the kernel's OOM killer sends SIGKILL; no "
        "cgroup OOM counter is readable here)")
    assert unreadable.oom.killed_text(1) == "exit code 1"
    assert unreadable.oom.killed_text(-15) == "killed by SIGTERM"


def test_the_counter_is_found_from_proc_self_cgroup_in_v1_and_v2(tmp_path):
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("12:pids:/a\n4:memory:/process_api/abc\n0::/user.slice/run-1\n")
    root = tmp_path / "sys"
    files = oom.counter_files(str(cgroup), str(root))
    assert files == [str(root / "memory/process_api/abc/memory.oom_control"),
                     str(root / "user.slice/run-1/memory.events"),
                     str(root / "memory.events"), str(root / "memory/memory.oom_control")]
    assert oom.oom_kill_count(files) is None
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.oom_control").write_text(OOM_CONTROL.format(n=7))
    assert oom.oom_kill_count(files) == 7
    (root / "memory.events").write_text(EVENTS.format(n=2))
    assert oom.oom_kill_count(files) == 2             # the more specific file first
