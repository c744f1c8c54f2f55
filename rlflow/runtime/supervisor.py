"""``rlflow train``: start and supervise the rlflow programs on one machine, the learner
(one process per learner host) and N sampler replicas.

**One machine** (``rlflow train``): :func:`run_train` writes the resolved config to the run
folder, picks two free loopback ports (ring buffer, weight coordinator), and starts

    python -m rlflow.runtime.launch --role learner     (XLA sees learner.num_devices devices)
    python -m rlflow.runtime.launch --role sampler     (XLA sees sampler.num_devices devices)

as separate OS processes, each its own JAX runtime, the sampler ``sampler.num_replicas``
times (replica ``i`` gets ``RLFLOW_REPLICA=i``; its log is ``logs/sampler-<i>.log``, or
``logs/sampler.log`` for a single replica). On CPU each child gets its own fake
device count through ``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set in the
child's environment before JAX is imported. The children run in their own session (so a
terminal Ctrl-C reaches only the launcher) and die with it (``PR_SET_PDEATHSIG``). Their
output goes to ``<run>/logs/<role>.log``; the launcher prints one progress line per learner
step (read from the run folder's metrics JSONL).

Re-runs: with ``checkpoint.resume="auto"`` the launcher reads the run folder's newest
checkpoint step first (:func:`rlflow.runtime.run_watch.latest_checkpoint_step`: folder names only,
no JAX): at or past ``learner.num_steps`` it says the run is already complete and exits 0
without starting anything or touching the run folder; below it, it prints ``resuming run
<name> from step N`` and the summary counts the steps run by this invocation
(``steps_this_run``, ``resumed_from_step`` in ``summary.json``). A run folder holds one run
(:mod:`rlflow.run.identity`): ``resume="never"`` on an earlier run's folder is refused (exit 2,
the folder named) unless ``checkpoint.overwrite`` moves it aside; ``resume="auto"`` on a
folder of another model / data / reward is refused. The ring-buffer token reaches the
programs in their environment (``RLFLOW_BUFFER_TOKEN``), never in argv; their
``config.json`` holds it redacted (:mod:`rlflow.config.secrets`).

Shutdown: when the learner finishes, the sampler is told to stop (the coordinator's "done"
flag, then SIGTERM after a grace period) and the exit code is 0. When either child dies
first (with several replicas: when every replica died), or on Ctrl-C / SIGTERM, all are
stopped (SIGTERM, which the learner answers with its exit checkpoint, then SIGKILL after
``STOP_GRACE_S``) and the exit code is not 0; the message names the side that died, puts
its last exception line first (``rlflow train: the sampler failed: ValueError:
.../bad.jsonl:7: ...``) and then shows the end of its log (for an error about the user's
input, a ``DataError`` or ``ConfigError``, only the log's path). Samplers that die after the
learner's last step (``metrics.jsonl`` has it) end the run with 0 when the learner then exits
0 within ``LEARNER_FINISH_S`` (its final checkpoint saved): one warning line names their
error (``the sampler process stopped after the learner's last step (...)``). With
``runtime.restart_sampler`` a dead replica is started again (it pulls the newest weights
from the coordinator, never the initial ones) up to ``MAX_SAMPLER_RESTARTS`` times; without
it a dead replica stays dead and the others carry the run (the learner hands its leased
prompts to them, ``rlflow.runtime.ledger``).

**Learner hosts** (``learner.num_hosts = N > 1``): the learner is N processes, one per
host, ``learner.num_devices / N`` fake devices each, joined by ``jax.distributed``
(``127.0.0.1:<free port>``, gloo); children ``learner`` (host 0) and ``learner-<i>``
(:mod:`rlflow.runtime.learner_hosts`). Any of them exiting before the run is done stops the
run, naming the host (``learner host 1 (pid N) ... killed by SIGKILL``).

A program killed by SIGKILL is named as out of memory when this cgroup's OOM-kill counter
rose during the run (``killed by SIGKILL: out of memory (the kernel's OOM killer ...)``),
else ``killed by SIGKILL (possibly out of memory: ...)`` with its peak resident memory
(:mod:`rlflow.runtime.oom`; no root, no ``dmesg``).

Each program is one process running :mod:`rlflow.runtime.launch` (its entry on a TPU pod
too); ``runtime.pin_cpus`` gives each its own CPUs (half each, :func:`split_cpus`).
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

from rlflow.run import files
from rlflow.runtime import programs_common as pc
from rlflow.exchange.ring import ProducerError
from rlflow.runtime import host_memory, learner_hosts
from rlflow.runtime.child_logs import (LOG_TAIL_LINES, is_input_error, program_error,
                                       tail, without_repeated_fatal)
from rlflow.runtime.oom import OomWatch
from rlflow.runtime.ports import free_port, port_taken
from rlflow.config.secrets import ENV_BUFFER_TOKEN

MAX_SAMPLER_RESTARTS = 3
STOP_GRACE_S = 20.0       # seconds a child gets between the stop request and SIGKILL
POLL_S = 0.2
PROCESSES_FILE = "processes.json"   # {"learner": pid, "sampler": pid} in the run folder
BOTH_DIED_WINDOW_S = 2.0  # a second death this soon after the first is reported as well
LEARNER_FINISH_S = 600.0  # seconds a learner past its last step gets to exit once the samplers died


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
        memory when the cgroup's OOM-kill counter rose (:mod:`rlflow.runtime.oom`)."""
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
                [sys.executable, "-m", "rlflow.runtime.launch", "--role", role,
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
        from rlflow.console.progress import plain_text

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
        """The failure report of child ``role``: its last exception line first (when its log
        has a traceback), then the exit status and the last ``LOG_TAIL_LINES`` lines of its
        log; for an error about the user's input (:func:`child_logs.is_input_error`: a bad
        data record, a config field, a broken reward function) the exception line and the
        log's path only; the same for a learner that stopped on a sampler's reported error
        (``ProducerError``: that sampler's own report comes first), or a learner host that
        left its slice because another host died (``learner_hosts.PeerLostError``)."""
        from rlflow.console.progress import plain_text     # no control characters in CI logs

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


def run_train(cfg) -> int:
    """``rlflow train``: run both programs on this machine until the learner finishes.

    Returns:
      0 when the learner completed ``learner.num_steps`` (also when the run folder's
      checkpoint already had, with ``checkpoint.resume="auto"``: then nothing is started);
      1 when a program died (the message on stderr names it and shows its log; samplers that
      die after the learner's last step are a warning, see the module docstring); 2 when the
      run folder cannot be used (another run's, a file in the way, read-only, or in use by
      another ``rlflow train``: :mod:`rlflow.runtime.run_lock`; a ``--run-dir`` URL whose
      file system this machine cannot write, :func:`rlflow.run.files.check_backend`;
      nothing started); 75 (:data:`rlflow.run.files.NO_SPACE_EXIT_CODE`) when the run
      folder's file system is full or read-only (one line naming it and its free space;
      the same command resumes once there is space); 130 on Ctrl-C.
    """
    from rlflow.runtime.run_lock import RunFolderInUse, RunLock

    run_path = files.absolute(cfg.run_path)
    problem = files.check_backend(run_path)     # gs:// without gcsfs: say so, start nothing
    if problem:
        print(f"rlflow train: {problem}", file=sys.stderr, flush=True)
        return 2
    try:                                  # one launcher per run folder (rlflow.runtime.run_lock)
        lock = RunLock(run_path).acquire()
    except RunFolderInUse as e:
        print(f"rlflow train: {e}", file=sys.stderr, flush=True)
        return 2
    except OSError as e:                  # a read-only --run-dir, no space
        _cannot_use(run_path, e)
        return 2
    try:
        return _run_train(cfg, run_path)
    finally:
        lock.release()


def _run_train(cfg, run_path: str) -> int:
    """:func:`run_train` with the run folder's lock held."""
    from rlflow.run.identity import RunFolderConflict, check_run_folder, prepare_run_folder
    from rlflow.runtime.run_watch import (RunWatcher, discard_records_after,
                                          latest_checkpoint_step, mark_complete)
    from rlflow.config.secrets import SecretError, resolve_secrets

    try:
        cfg = resolve_secrets(cfg)
        check_run_folder(cfg)                 # another run's folder: refuse, touch nothing
    except (SecretError, RunFolderConflict) as e:
        print(f"rlflow train: {e}", file=sys.stderr, flush=True)
        return 2
    for name, host, port in (("buffer.port", cfg.buffer.bind_address, cfg.buffer.port),
                              ("runtime.coordinator_port", cfg.runtime.bind_address,
                               cfg.runtime.coordinator_port)):
        if port and port_taken(host, port):   # else the learner fails with a zmq traceback
            print(f"rlflow train: {name}: port {port} on {host} is in use (another run or "
                  f"program listens there): choose a free port, or 0 (the default) to let "
                  f"rlflow pick one", file=sys.stderr, flush=True)
            return 2
    resumed_from = 0
    if cfg.checkpoint.resume == "auto":
        step = latest_checkpoint_step(run_path)
        total = cfg.learner.num_steps
        if step is not None and step >= total:
            where = (f"step {step} of {total}" if step == total else
                     f"its checkpoint is at step {step}, past --learner.num_steps {total}")
            print(f"rlflow train: run {cfg.name} is already complete ({where}); "
                  f"use a new --name, or --checkpoint.resume never --checkpoint.overwrite true to "
                  f"start over", flush=True)
            mark_complete(run_path, step)
            return 0
        if step is not None:
            print(f"rlflow train: resuming run {cfg.name} from step {step} (of {total})",
                  flush=True)
            if cfg.checkpoint.overwrite:      # it acts only with resume="never"
                print("rlflow train: --checkpoint.overwrite is ignored with --checkpoint.resume "
                      "auto (it resumes); to start over use --checkpoint.resume never "
                      "--checkpoint.overwrite true", flush=True)
            resumed_from = step
    try:                                  # the run folder: every write before a program starts
        prepared = prepare_run_folder(cfg)
        if prepared.moved_to:
            print(f"rlflow train: moved the earlier run in {run_path} to {prepared.moved_to} "
                  "(--checkpoint.overwrite)", flush=True)
        for warning in prepared.warnings:
            print(f"rlflow train: {warning}", flush=True)
        # Before anything reads them: records of steps after the checkpoint this invocation
        # starts from belong to an interrupted invocation (the learner recomputes those steps).
        for name, n in discard_records_after(run_path, resumed_from).items():
            print(f"rlflow train: {name}: removed {n} record(s) of steps after {resumed_from} "
                  "(written after the checkpoint this run resumes from)", flush=True)
        config_path = files.join(run_path, "config.json")
        pc.save_config(cfg, config_path)
    except OSError as e:                  # a file in the way, a read-only mount, no space
        _cannot_use(run_path, e)
        return 2
    bhost, chost = cfg.buffer.bind_address, cfg.runtime.bind_address
    buffer_port = cfg.buffer.port or free_port(bhost, exclude={cfg.runtime.coordinator_port})
    coordinator_port = cfg.runtime.coordinator_port or free_port(chost, exclude={buffer_port})
    endpoints = pc.Endpoints(buffer=f"{bhost}:{buffer_port}",
                             coordinator=f"{chost}:{coordinator_port}")
    jax_port = free_port(exclude={buffer_port, coordinator_port})
    sup = Supervisor(cfg, run_path, config_path, endpoints,
                     jax_coordinator=f"127.0.0.1:{jax_port}")
    # Before the progress display exists (a live bar would draw over it).
    logs = os.path.join(files.local_side(run_path), "logs")
    print(f"rlflow train: run folder {run_path} (logs in {logs})", flush=True)
    watcher = RunWatcher(cfg, run_path, resumed_from=resumed_from)
    code = 1
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for name in learner_hosts.learner_names(cfg.learner.num_hosts):
            sup.start(name)
        for name in sup.sampler_names():
            sup.start(name)
        code = _supervise(cfg, sup, watcher)
    except KeyboardInterrupt:
        watcher.progress.close()            # a live bar would redraw over the lines below
        print("\nrlflow train: interrupted; stopping both programs", file=sys.stderr, flush=True)
        code = 130
    except OSError as e:                    # the launcher's own writes: a program's log,
        if files.no_space(e) is None:       # processes.json
            raise
        watcher.progress.close()
        print(f"rlflow train: {files.full_line(run_path, files.no_space(e))}",
              file=sys.stderr, flush=True)
        code = files.NO_SPACE_EXIT_CODE
    finally:
        for sig in previous:                # a second Ctrl-C no longer interrupts the stop
            signal.signal(sig, signal.SIG_IGN)
        sup.stop_all()
        watcher.poll()
        try:
            watcher.close(success=(code == 0))
        except OSError as e:                # summary.json on a full disk: one line, no .tmp
            if files.no_space(e) is None:
                raise
            if code != files.NO_SPACE_EXIT_CODE:    # not said already
                line = files.full_line(run_path, files.no_space(e), "summary.json")
                print(f"rlflow train: {line}", file=sys.stderr, flush=True)
            code = code or files.NO_SPACE_EXIT_CODE
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def _cannot_use(run_path: str, e: OSError) -> None:
    """The one line for a run folder the launcher cannot write before any program starts."""
    if files.no_space(e) is not None:
        print(f"rlflow train: {files.full_line(run_path, files.no_space(e))}", file=sys.stderr,
              flush=True)
        return
    print(f"rlflow train: cannot use the run folder {run_path} (--run-dir / --name): "
          f"{e.strerror or e}: {e.filename or run_path}", file=sys.stderr, flush=True)


def _interrupt(signum, frame):
    """Ctrl-C or SIGTERM to the launcher (also when started in the background, where
    SIGINT would otherwise be ignored): stop both programs cleanly."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _supervise(cfg, sup: Supervisor, watcher) -> int:
    """Watch the learner and the sampler replicas until the learner finishes.

    A replica that dies is restarted with ``runtime.restart_sampler`` (up to
    ``MAX_SAMPLER_RESTARTS`` times each); otherwise it stays dead and the run goes on with
    the others (the learner gives its prompts to them after ``runtime.replica_timeout_s``).
    The run fails when the learner dies or when every replica is dead for good.
    """
    learner_done_at = None
    dead: set[str] = set()              # replicas dead for good
    names = sup.sampler_names()
    hosts = learner_hosts.learner_names(cfg.learner.num_hosts)
    while True:
        watcher.poll()
        sup.sample_memory()
        learner = sup.children["learner"].proc.poll()
        codes = {n: sup.children[n].proc.poll() for n in names}
        failed = [h for h in hosts if sup.children[h].proc.poll() not in (None, 0)]
        if failed:      # a host killed by a signal first: the others fail because of it
            watcher.progress.close()        # the bar stops before the failure report
            first = min(failed, key=lambda h: sup.children[h].proc.poll() >= 0)
            if len(hosts) > 1:      # the others may wait for it in a barrier: they leave now
                learner_hosts.notify_lost_peer(
                    {h: sup.children[h].proc for h in hosts}, first)
            return _report_failures(sup, first)
        if learner is not None:
            if all(c is not None for c in codes.values()):
                return 0
            learner_done_at = learner_done_at or time.monotonic()
            if time.monotonic() - learner_done_at > STOP_GRACE_S:
                return 0      # finally: stop_all() ends the samplers
            time.sleep(POLL_S)
            continue
        for name, code in codes.items():
            if code is None or code == 0 or name in dead:
                continue      # 0: the replica saw the coordinator's "done"
            child = sup.children[name]
            n = child.restarts
            watcher.reported_dead.add(name)     # said here: not again when the learner notices
            if cfg.runtime.restart_sampler and n < MAX_SAMPLER_RESTARTS:
                watcher.progress.message(    # above a live bar, never through it
                    f"rlflow train: the {name} process died ({sup.exit_text(name)}); "
                    f"restarting it ({n + 1}/{MAX_SAMPLER_RESTARTS})")
                sup.start(name, instance=n + 1)
            else:
                dead.add(name)
                if len(dead) < len(names):
                    watcher.progress.message(
                        f"rlflow train: the {name} process died ({sup.exit_text(name)}); "
                        f"going on with {len(names) - len(dead)} sampler replica(s)")
        if dead and len(dead) == len(names):
            watcher.poll()
            past_last = watcher.last_step >= cfg.learner.num_steps
            if past_last and any(sup.children[h].proc.poll() is None for h in hosts):
                watcher.progress.message(
                    f"rlflow train: every sampler stopped after the learner's last step; "
                    f"waiting for the learner to save its final checkpoint and exit (up to "
                    f"{LEARNER_FINISH_S:.0f} s)")
            if past_last and _learner_finishes(sup, hosts, LEARNER_FINISH_S):
                # every step trained before the samplers died: the run did its work
                watcher.progress.close()
                print(sup.after_last_step(sorted(dead)[-1]), file=sys.stderr, flush=True)
                return 0
            watcher.progress.close()
            if len(names) > 1:
                print(f"rlflow train: every sampler replica died ({len(names)}); stopping "
                      f"the run", file=sys.stderr, flush=True)
            return _report_failures(sup, sorted(dead)[-1])
        time.sleep(POLL_S)


def _learner_finishes(sup: Supervisor, hosts: Sequence[str], timeout_s: float) -> bool:
    """Whether every learner host exits 0 within ``timeout_s`` seconds (all of them
    together): after its last step the learner saves its final checkpoint and then waits up
    to ``rlflow.learner.program.DONE_GRACE_S`` for samplers that will not answer."""
    deadline = time.monotonic() + timeout_s
    for h in hosts:
        try:
            code = sup.children[h].proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        if code != 0:
            return False
    return True


def _report_failures(sup: Supervisor, first: str) -> int:
    """Print the failure of ``first``, and of the other program too when it dies within
    ``BOTH_DIED_WINDOW_S`` (a sampler error reported to the learner ends both); a full run
    folder is one line. Returns the launcher's exit code: 1, or
    :data:`rlflow.run.files.NO_SPACE_EXIT_CODE` for a full run folder."""
    if first.startswith("learner"):
        others = [n for n in sup.children if n.startswith("sampler")][:1]
        others += [n for n in sup.children if n.startswith("learner") and n != first]
    else:
        others = ["learner"]
    roles = [first]
    deadline = time.monotonic() + BOTH_DIED_WINDOW_S      # one window for all of them
    for other in others:
        try:
            code = sup.children[other].proc.wait(
                timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        if code not in (None, 0, pc.STOPPED_EXIT_CODE):
            roles.append(other)
    full = [r for r in roles if sup.no_space(r) is not None]
    if full:                          # one line: the folder, its free space (issue 39)
        roles = full[:1]
    for role in sorted(roles, key=lambda r: r.startswith("learner")):  # the producer's first
        print(sup.failure(role), file=sys.stderr, flush=True)
    return files.NO_SPACE_EXIT_CODE if full else 1
