"""The launcher's child processes (``rlflow train`` on one machine, :mod:`rlflow.launcher.
supervisor`): each program's environment and CPUs, starting one (``python -m
rlflow.launcher.launch``, its own session, its log under ``<run>/logs/<name>.log``), the run
folder's ``processes.json``, stopping them all (SIGTERM, then SIGKILL after
``STOP_GRACE_S``), and what a child's exit and log say (its exit code or signal, an OOM kill
named, a full run folder, the failure report with its last exception line and the end of its
log).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from rlflow.config.secrets import ENV_BUFFER_TOKEN
from rlflow.exchange.ring import ProducerError
from rlflow.run import files
from rlflow.system import host_memory
from rlflow.launcher import learner_hosts
from rlflow.control import programs_common as pc
from rlflow.launcher.child_logs import (LOG_TAIL_LINES, is_input_error, program_error,
                                       tail, without_repeated_fatal)
from rlflow.system.oom import OomWatch

STOP_GRACE_S = 20.0       # seconds a child gets between the stop request and SIGKILL
PROCESSES_FILE = "processes.json"   # {"learner": pid, "sampler": pid} in the run folder


def child_env(role: str, num_devices: int, endpoints: pc.Endpoints, config_path: str,
              base: Optional[dict] = None) -> dict:
    """Environment of one program: its own fake device count, its role and addresses.

    Any ``--xla_force_host_platform_device_count`` inherited from the parent is replaced.
    """
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={num_devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env[pc.ENV_PARENT_PID] = str(os.getpid())
    env[pc.ENV_ROLE] = role
    env[pc.ENV_CONFIG] = config_path
    env.update(endpoints.to_env())
    return env


def split_cpus(cpus: Sequence[int]) -> dict[str, list[int]]:
    """``runtime.pin_cpus``: the learner gets the first half (rounded up), the sampler the
    rest; an empty dict (no pinning) with fewer than 2 CPUs."""
    cpus = sorted(cpus)
    if len(cpus) < 2:
        return {}
    half = (len(cpus) + 1) // 2
    return {"learner": cpus[:half], "sampler": cpus[half:]}


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    log_path: str
    restarts: int = 0


@dataclass
class Supervisor:
    """Starts the two programs and watches them (thin stateful shell around Popen)."""

    cfg: object
    run_path: str
    config_path: str
    endpoints: pc.Endpoints
    children: dict = field(default_factory=dict)
    jax_coordinator: str = ""     # host:port of the learner hosts' jax.distributed (N > 1)
    oom: OomWatch = field(default_factory=OomWatch)   # the OOM-kill counter at the start

    def exit_text(self, name: str) -> str:
        """How child ``name`` ended: its exit code or signal, a SIGKILL named as out of
        memory when the cgroup's OOM-kill counter rose (:mod:`rlflow.system.oom`)."""
        c = self.children[name]
        return self.oom.killed_text(c.proc.returncode, c.proc.pid)

    def sample_memory(self) -> None:
        """Record each live child's peak resident memory (for :meth:`exit_text`)."""
        for c in self.children.values():
            if c.proc.poll() is None:
                self.oom.sample(c.proc.pid)

    def sampler_names(self) -> list[str]:
        """Child names of the sampler replicas: ``["sampler"]`` for one replica (its log is
        ``logs/sampler.log``), else ``sampler-0 .. sampler-<N-1>``."""
        n = self.cfg.sampler.num_replicas
        return ["sampler"] if n == 1 else [f"sampler-{i}" for i in range(n)]

    def start(self, name: str, instance: int = 0) -> Child:
        """Start child ``name`` ("learner", or a name of :meth:`sampler_names`); its
        ``instance`` is its restart count."""
        lc = self.cfg.learner
        role = "learner" if name.startswith("learner") else "sampler"
        num_devices = (lc.num_devices // lc.num_hosts if role == "learner"
                       else self.cfg.sampler.num_devices)
        eps = pc.Endpoints(self.endpoints.buffer, self.endpoints.coordinator, instance)
        env = child_env(role, num_devices, eps, self.config_path)
        if role == "learner":
            env = host_memory.allocator_env(env, self.cfg.runtime.keep_freed_host_memory)
            env.update(learner_hosts.host_env(name, lc.num_hosts, self.jax_coordinator))
        else:
            env[pc.ENV_REPLICA] = name.rsplit("-", 1)[1] if "-" in name else "0"
        if self.cfg.buffer.token:     # by environment, never argv (config.json: redacted)
            env[ENV_BUFFER_TOKEN] = self.cfg.buffer.token
        if self.cfg.runtime.pin_cpus and hasattr(os, "sched_getaffinity"):
            cpus = split_cpus(os.sched_getaffinity(0)).get(role)
            if cpus:
                env[pc.ENV_CPUS] = ",".join(map(str, cpus))
        # local even for an object-store run folder: a child writes it with plain file calls
        log_path = os.path.join(files.local_side(self.run_path), "logs", f"{name}.log")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"--- rlflow {role} start #{instance} ---\n".encode())
            log.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", "rlflow.launcher.launch", "--role", role,
                 "--config", self.config_path],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        child = Child(name, proc, log_path, restarts=instance)
        self.children[name] = child
        self._write_pids()
        return child

    def _write_pids(self) -> None:
        files.write_atomic(files.join(self.run_path, PROCESSES_FILE),
                           json.dumps({r: c.proc.pid for r, c in self.children.items()}))

    def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every live child, wait up to ``grace_s``, then SIGKILL."""
        for c in self.children.values():
            if c.proc.poll() is None:
                try:
                    c.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for c in self.children.values():
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()

    def after_last_step(self, role: str) -> str:
        """The warning for sampler ``role`` dying after the learner's last step (every step
        trained, final checkpoint saved: the run succeeds): its last exception line, or its
        exit status when its log has no traceback, and its log's path."""
        from rlflow.launcher.progress import plain_text

        c = self.children[role]
        error = program_error(c.log_path, "--- rlflow sampler start")
        what = plain_text(error) if error else self.exit_text(role)
        return (f"rlflow train: warning: the {role} process stopped after the learner's last "
                f"step ({what}); every step trained and the final checkpoint is saved. Its log "
                f"is {c.log_path}")

    def no_space(self, role: str) -> Optional[OSError]:
        """An OSError (ENOSPC / EROFS) when child ``role`` stopped because the run folder's
        file system is full or read-only: its exit code says so
        (:data:`rlflow.run.files.NO_SPACE_EXIT_CODE`), or the end of its log names the
        error (a program that could not say it in its exit code); else None."""
        c = self.children[role]
        text = tail(c.log_path, LOG_TAIL_LINES) if os.path.isfile(c.log_path) else ""
        for code, words in ((errno.EROFS, ("Read-only file system", "[Errno 30]")),
                            (errno.EDQUOT, ("Disk quota exceeded", "[Errno 122]")),
                            (errno.ENOSPC, ("No space left on device", "[Errno 28]"))):
            if any(w in text for w in words):
                return OSError(code, os.strerror(code))
        free = files.free_bytes(self.run_path)
        if c.proc.returncode == files.NO_SPACE_EXIT_CODE or (
                free is not None and free < files.NEARLY_FULL_BYTES):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))   # a log cut short
        return None

    def failure(self, role: str) -> str:
        """:meth:`_failure`, with the run's secrets (the buffer token, the served rewards'
        API keys, :func:`rlflow.config.secrets.secret_values`) redacted in every form: a
        log written without redaction must not put them on the terminal."""
        from rlflow.config.secrets import redact_text, secret_values

        return redact_text(self._failure(role), secret_values(self.cfg))

    def _failure(self, role: str) -> str:
        """The failure report of child ``role``: its last exception line first (when its log
        has a traceback), then the exit status and the last ``LOG_TAIL_LINES`` lines of its
        log; for an error about the user's input (:func:`child_logs.is_input_error`: a bad
        data record, a config field, a broken reward function) the exception line and the
        log's path only; the same for a learner that stopped on a sampler's reported error
        (``ProducerError``: that sampler's own report comes first), or a learner host that
        left its slice because another host died (``learner_hosts.PeerLostError``)."""
        from rlflow.launcher.progress import plain_text     # no control characters in CI logs

        c = self.children[role]
        kind = "learner" if role.startswith("learner") else "sampler"
        error = program_error(c.log_path, f"--- rlflow {kind} start")    # this start's only
        what = role if kind == "sampler" else \
            learner_hosts.host_label(role, c.proc.pid, self.cfg.learner.num_hosts)
        full = self.no_space(role)
        if full is not None:          # its log may be cut short: the folder is full
            return f"rlflow train: the {what} stopped: {files.full_line(self.run_path, full)}"
        head = f"rlflow train: the {what} failed: {plain_text(error)}\n" if error else ""
        if error and is_input_error(error):    # the message says it all: no traceback
            return head + (f"rlflow train: the {what} stopped on bad input "
                           f"({self.exit_text(role)}); stopping the run. Its traceback "
                           f"is in {c.log_path}")
        if error and error.startswith(f"{ProducerError.__module__}.{ProducerError.__name__}:"):
            return (f"rlflow train: the {what} stopped because a sampler failed (above; "
                    f"{self.exit_text(role)}); its log is {c.log_path}")
        lost = learner_hosts.PeerLostError
        if error and error.startswith(f"{lost.__module__}.{lost.__name__}:"):
            return (f"rlflow train: the {what} stopped because another learner host died "
                    f"(above; {self.exit_text(role)}); its log is {c.log_path}")
        text = (f"rlflow train: the {what} process died ({self.exit_text(role)}); "
                f"stopping the run. Last lines of {c.log_path}:\n")
        lines = without_repeated_fatal(tail(c.log_path, LOG_TAIL_LINES).splitlines())
        return head + text + "\n".join(f"  [{role}] {plain_text(line)}" for line in lines)
