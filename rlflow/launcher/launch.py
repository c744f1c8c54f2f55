"""Entry of one rlflow program process: ``python -m rlflow.launcher.launch --role R --config C``.

On one machine :mod:`rlflow.launcher.supervisor` (``rlflow train``) starts these processes;
on a TPU pod the launch scripts do.

**TPU pod** (one learner slice, one or more sampler slices): ``scripts/tpu`` / ``scripts/xpk``
start ``python -m rlflow.launcher.launch --role learner --config <resolved config.json>`` on
every host of the learner slice (with ``--learner.num_hosts`` = its host count) and
``--role sampler`` on every host of every sampler slice (each sampler host is one replica,
its own JAX program: ``RLFLOW_NUM_PROCESSES=1``, ``RLFLOW_REPLICA=<index>``), with:

    RLFLOW_BUFFER_ADDRESS       host:port of the learner's ring buffer (learner host 0 binds it)
    RLFLOW_COORDINATOR_ADDRESS  host:port of the learner's weight coordinator
    RLFLOW_JAX_COORDINATOR      host:port of this slice's jax.distributed coordinator
    RLFLOW_NUM_PROCESSES        hosts in this slice
    RLFLOW_PROCESS_ID           this host's index in its slice

:func:`run_role` runs the learner through :func:`rlflow.launcher.learner_hosts.run_learner`
(the entry every learner host runs, here and on a pod).

Other knobs: ``runtime.pin_cpus`` gives each program its own CPUs (``RLFLOW_CPUS``);
``RLFLOW_PROFILE=<dir>`` writes a cProfile of each program to ``<dir>/<role>.prof``;
``kill -USR1 <pid>`` dumps a program's Python stacks into its log.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import traceback
from typing import Optional, Sequence

# transformers' "PyTorch was not found" advisory (printed when it is imported without torch,
# which rlflow never needs): not in every program's log. Before anything imports it.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from rlflow.run import files  # noqa: E402
from rlflow.control import programs_common as pc
from rlflow.system import host_memory
from rlflow.launcher import learner_hosts
from rlflow.launcher.child_logs import fatal_line
from rlflow.config.secrets import (install_log_redaction, install_stream_redaction,
                                   redact_installed, secret_values)


def _distributed_init(env=None) -> None:
    """``jax.distributed.initialize`` for this program's own slice, when it has > 1 host."""
    env = os.environ if env is None else env
    n = int(env.get(pc.ENV_NUM_PROCESSES, "1"))
    if n <= 1:
        return
    import jax

    jax.distributed.initialize(coordinator_address=env[pc.ENV_DIST_COORDINATOR],
                               num_processes=n, process_id=int(env[pc.ENV_PROCESS_ID]))


def run_role(role: str, cfg, endpoints: pc.Endpoints) -> int:
    """Run one program in this process (after ``jax.distributed`` set-up on a pod).

    Returns 0 when the program finished; raises what the program raised otherwise.
    """
    if role not in pc.ROLES:
        raise ValueError(f"role must be one of {pc.ROLES}, got {role!r}")
    if role == "learner":               # one host or a slice of learner.num_hosts hosts
        from rlflow.launcher.learner_hosts import run_learner

        run_learner(cfg, endpoints)
        return 0
    _distributed_init()
    import jax

    if jax.process_count() > 1:         # a sampler host is one replica (scripts/tpu)
        raise NotImplementedError(
            f"a sampler replica runs on one host; this slice has {jax.process_count()} hosts "
            "(RLFLOW_NUM_PROCESSES): start one replica per host with RLFLOW_NUM_PROCESSES=1")
    from rlflow.sampler.program import main as program_main

    program_main(cfg, endpoints)
    return 0


def child_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry of ``python -m rlflow.launcher.launch --role R --config C``: one program, one process."""
    ap = argparse.ArgumentParser(prog="python -m rlflow.launcher.launch")
    ap.add_argument("--role", choices=pc.ROLES, default=os.environ.get(pc.ENV_ROLE))
    ap.add_argument("--config", default=os.environ.get(pc.ENV_CONFIG),
                    help="resolved config JSON (written by rlflow train)")
    args = ap.parse_args(argv)
    if not args.role or not args.config:
        ap.error("--role and --config (or RLFLOW_ROLE / RLFLOW_CONFIG) are required")
    _die_with_parent()
    _pin_cpus()                             # before JAX starts its thread pools
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 pid`: stacks to log
    log = pc.setup_logging(args.role)
    pc.install_signal_handlers()
    cfg = pc.load_config(args.config)
    secrets = secret_values(cfg)            # a token or key in an error message stays hidden:
    install_log_redaction(secrets)          # in log lines and logged tracebacks,
    install_stream_redaction(secrets)       # and in whatever reaches stdout / stderr
    note = (host_memory.startup_note(os.environ, cfg.runtime.keep_freed_host_memory)
            if args.role == "learner" else None)
    if note:
        log.info("host memory: %s", note)
    profile = os.environ.get(pc.ENV_PROFILE)
    if profile:                             # RLFLOW_PROFILE=dir: cProfile stats per program
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        return run_role(args.role, cfg, pc.Endpoints.from_env())
    except pc.Stopped as e:
        log.info("stopped: %s", e)
        return pc.STOPPED_EXIT_CODE
    finally:
        if profile:
            profiler.disable()
            os.makedirs(profile, exist_ok=True)
            profiler.dump_stats(os.path.join(profile, f"{args.role}.prof"))


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent (the launcher) dies; exit now if
    the parent is already gone. No-op elsewhere."""
    if os.environ.get(pc.ENV_PARENT_PID) is None:
        return                              # started by hand or by the TPU scripts
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(os.environ[pc.ENV_PARENT_PID]):
        sys.exit("rlflow: the launcher exited before this program started")


def _pin_cpus(env=None) -> None:
    """Restrict this process to the CPUs in ``RLFLOW_CPUS`` (set by ``runtime.pin_cpus``)."""
    env = os.environ if env is None else env
    if env.get(pc.ENV_CPUS) and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in env[pc.ENV_CPUS].split(",")})


def run_child(argv: Optional[Sequence[str]] = None) -> int:
    """:func:`child_main` with its failure made a line for the launcher: the traceback and
    :func:`rlflow.launcher.child_logs.fatal_line` (exit code 1), or, when the run folder's
    file system is full or read-only (:func:`rlflow.run.files.no_space` anywhere in the
    exception's chain: a metrics line, a checkpoint, the ledger), the one line of
    :func:`rlflow.run.files.full_line` and exit code
    :data:`rlflow.run.files.NO_SPACE_EXIT_CODE` (the launcher reads it even when the log,
    in the full folder, could not be written)."""
    try:
        exit_code = child_main(argv)
        learner_hosts.leave_background_compiles(exit_code)   # returns unless only they're left
        return exit_code
    except Exception as e:              # the traceback, then the line the launcher reports
        full = files.no_space(e)
        try:
            if full is not None:
                folder = os.path.dirname(os.environ.get(pc.ENV_CONFIG) or ".")
                print(f"rlflow: {files.full_line(folder, full)}", file=sys.stderr, flush=True)
            else:                       # redacted as the log lines (a key echoed back)
                sys.stderr.write(redact_installed(traceback.format_exc()))
                print(redact_installed(fatal_line(e)), file=sys.stderr, flush=True)
        except OSError:                 # the log itself is on the full file system
            pass
        return 1 if full is None else files.NO_SPACE_EXIT_CODE


if __name__ == "__main__":
    try:
        exit_code = run_child()
    finally:
        pc.arm_exit_watchdog()          # no thread stuck at exit keeps this process alive
    sys.exit(exit_code)
