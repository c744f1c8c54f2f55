"""``rlflow train``: start and supervise the rlflow programs on one machine, the learner
(one process per learner host) and N sampler replicas.

**One machine** (``rlflow train``): :func:`run_train` writes the resolved config to the run
folder, picks two free loopback ports (ring buffer, weight coordinator), and starts

    python -m rlflow.launcher.launch --role learner     (XLA sees learner.num_devices devices)
    python -m rlflow.launcher.launch --role sampler     (XLA sees sampler.num_devices devices)

as separate OS processes, each its own JAX runtime, the sampler ``sampler.num_replicas``
times (replica ``i`` gets ``RLFLOW_REPLICA=i``; its log is ``logs/sampler-<i>.log``, or
``logs/sampler.log`` for a single replica). On CPU each child gets its own fake
device count through ``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set in the
child's environment before JAX is imported. The children run in their own session (so a
terminal Ctrl-C reaches only the launcher) and die with it (``PR_SET_PDEATHSIG``). Their
output goes to ``<run>/logs/<role>.log``; the launcher prints one progress line per learner
step (read from the run folder's metrics JSONL).

Re-runs: with ``checkpoint.resume="auto"`` the launcher reads the run folder's newest
checkpoint step first (:func:`rlflow.run.summary.latest_checkpoint_step`: folder names only,
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
prompts to them, ``rlflow.control.ledger``).

**Learner hosts** (``learner.num_hosts = N > 1``): the learner is N processes, one per
host, ``learner.num_devices / N`` fake devices each, joined by ``jax.distributed``
(``127.0.0.1:<free port>``, gloo); children ``learner`` (host 0) and ``learner-<i>``
(:mod:`rlflow.launcher.learner_hosts`). Any of them exiting before the run is done stops the
run, naming the host (``learner host 1 (pid N) ... killed by SIGKILL``).

A program killed by SIGKILL is named as out of memory when this cgroup's OOM-kill counter
rose during the run (``killed by SIGKILL: out of memory (the kernel's OOM killer ...)``),
else ``killed by SIGKILL (possibly out of memory: ...)`` with its peak resident memory
(:mod:`rlflow.system.oom`; no root, no ``dmesg``).

Each program is one process running :mod:`rlflow.launcher.launch` (its entry on a TPU pod
too); ``runtime.pin_cpus`` gives each its own CPUs (half each, :func:`split_cpus`). The
child processes themselves (environment, start, pids file, stop, exit and failure texts)
are kept by :class:`rlflow.launcher.children.Supervisor`; this module decides what happens
to the run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Sequence

from rlflow.run import files
from rlflow.control import programs_common as pc
from rlflow.launcher import learner_hosts
from rlflow.launcher.children import (PROCESSES_FILE, STOP_GRACE_S, Child, Supervisor,
                                     child_env, split_cpus)
from rlflow.system.ports import free_port, port_taken

# the child-process names stay importable from here (tests, scripts)
__all__ = ["run_train", "Supervisor", "Child", "child_env", "split_cpus", "PROCESSES_FILE",
           "STOP_GRACE_S", "MAX_SAMPLER_RESTARTS"]

MAX_SAMPLER_RESTARTS = 3
POLL_S = 0.2
BOTH_DIED_WINDOW_S = 2.0  # a second death this soon after the first is reported as well
LEARNER_FINISH_S = 600.0  # seconds a learner past its last step gets to exit once the samplers died


def run_train(cfg) -> int:
    """``rlflow train``: run both programs on this machine until the learner finishes.

    Returns:
      0 when the learner completed ``learner.num_steps`` (also when the run folder's
      checkpoint already had, with ``checkpoint.resume="auto"``: then nothing is started);
      1 when a program died (the message on stderr names it and shows its log; samplers that
      die after the learner's last step are a warning, see the module docstring); 2 when the
      run folder cannot be used (another run's, a file in the way, read-only, or in use by
      another ``rlflow train``: :mod:`rlflow.run.run_lock`; a ``--run-dir`` URL whose
      file system this machine cannot write, :func:`rlflow.run.files.check_backend`;
      nothing started); 75 (:data:`rlflow.run.files.NO_SPACE_EXIT_CODE`) when the run
      folder's file system is full or read-only (one line naming it and its free space;
      the same command resumes once there is space); 130 on Ctrl-C.
    """
    from rlflow.run.run_lock import RunFolderInUse, RunLock

    run_path = files.absolute(cfg.run_path)
    problem = files.check_backend(run_path)     # gs:// without gcsfs: say so, start nothing
    if problem:
        print(f"rlflow train: {problem}", file=sys.stderr, flush=True)
        return 2
    try:                                  # one launcher per run folder (rlflow.run.run_lock)
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
    from rlflow.run.summary import discard_records_after, latest_checkpoint_step, mark_complete
    from rlflow.launcher.run_watch import RunWatcher
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
            watcher.close(success=(code == 0), report=cfg.metrics.report)
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
