"""Launching a learner of several hosts (``learner.num_hosts > 1``): one process per host.

**Child side** (every learner host, on a laptop or a pod): :func:`run_learner` joins this
process to the learner slice (:func:`rlflow.learner.multihost.initialize`:
``jax.distributed`` with the coordinator ``RLFLOW_JAX_COORDINATOR``, gloo collectives on
CPU, :class:`~rlflow.learner.multihost.CoordinatorUnreachable` within the timeout when host
0 cannot be reached), then runs the learner program: host 0 the full program
(:mod:`rlflow.learner.program`), hosts 1..N-1 :func:`rlflow.learner.hosts.follower_main`.
``scripts/tpu`` and ``scripts/xpk`` start ``python -m rlflow.launcher.launch --role learner``
on every host of the learner slice with ``RLFLOW_NUM_PROCESSES`` / ``RLFLOW_PROCESS_ID`` /
``RLFLOW_JAX_COORDINATOR`` of that host: the same entry as below.

**Parent side** (``rlflow train --learner.num-hosts N`` on one machine):
:func:`learner_names` are the launcher's child names (``learner`` is host 0, its log
``logs/learner.log``; ``learner-<i>`` is host i); :func:`host_env` adds each host's slice
position and its fake device count (``learner.num_devices / N``); the coordinator is
``127.0.0.1:<free port>``. A host that exits before the run is done stops the run with the
host named (:func:`host_label`: ``learner host 1 (pid 4242)``); the launcher first tells the
other hosts (:func:`notify_lost_peer`), which leave at once with code 1 even while waiting in
a barrier for the dead one (:func:`watch_for_lost_peer`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Mapping, Optional

from rlflow.control import programs_common as pc

log = logging.getLogger("rlflow.learner")

JAX_INIT_TIMEOUT_S = 300.0     # seconds a host waits for host 0's coordinator / the others
# the launcher's notice to the other hosts that a host of the learner slice died
PEER_LOST_SIGNAL = signal.SIGUSR2
_peer_watch: list = []         # the watcher's socket pair, alive as long as the process


def learner_names(num_hosts: int) -> list[str]:
    """Launcher child names of the learner hosts: ``learner`` (host 0), ``learner-1``, ..."""
    return ["learner"] + [f"learner-{i}" for i in range(1, num_hosts)]


def host_index(name: str) -> int:
    """Host index of a learner child name (``learner`` -> 0, ``learner-3`` -> 3)."""
    return int(name.rsplit("-", 1)[1]) if "-" in name else 0


def host_label(name: str, pid: int, num_hosts: int) -> str:
    """How failure messages name a learner child: ``learner host 1 (pid 4242)``, or
    ``learner`` for a one-host learner."""
    if num_hosts <= 1:
        return "learner"
    return f"learner host {host_index(name)} (pid {pid})"


def host_env(name: str, num_hosts: int, jax_coordinator: str) -> dict[str, str]:
    """The slice-position variables of learner child ``name`` (empty for one host)."""
    if num_hosts <= 1:
        return {}
    return {pc.ENV_NUM_PROCESSES: str(num_hosts), pc.ENV_PROCESS_ID: str(host_index(name)),
            pc.ENV_DIST_COORDINATOR: jax_coordinator}


def join_slice(cfg, env=None) -> int:
    """Join this process to the learner slice; returns its host index (0 for one host).

    Raises:
      ValueError: ``RLFLOW_NUM_PROCESSES`` differs from ``learner.num_hosts`` (names both).
      rlflow.learner.multihost.CoordinatorUnreachable: host 0's coordinator did not answer
        within ``JAX_INIT_TIMEOUT_S``.
    """
    env = os.environ if env is None else env
    n = int(env.get(pc.ENV_NUM_PROCESSES, "1"))
    if n != cfg.learner.num_hosts:
        raise ValueError(f"{pc.ENV_NUM_PROCESSES}={n} hosts in this learner slice, but "
                         f"learner.num_hosts={cfg.learner.num_hosts}: set --learner.num-hosts {n}")
    if n == 1:
        return 0
    from rlflow.learner import multihost

    timeout = float(env.get("RLFLOW_JAX_INIT_TIMEOUT_S", JAX_INIT_TIMEOUT_S))
    multihost.initialize(multihost.DistributedConfig(
        coordinator_address=env[pc.ENV_DIST_COORDINATOR], num_processes=n,
        process_id=int(env[pc.ENV_PROCESS_ID]), init_timeout_s=timeout))
    import jax

    return jax.process_index()


class PeerLostError(RuntimeError):
    """This learner host stopped because another host of its slice died (never raised: its
    :func:`rlflow.launcher.child_logs.fatal_line` ends the host's log, so the launcher reports
    the host that died, not this consequence of it, with a traceback)."""


def _leave_slice(why: str) -> None:
    """Log ``why``, print the :class:`PeerLostError` fatal line and exit with code 1."""
    from rlflow.launcher.child_logs import fatal_line

    log.error("%s; exiting without the slice's shutdown", why)
    print(fatal_line(PeerLostError(why)), file=sys.stderr, flush=True)
    _exit_now(1)


def run_learner(cfg, endpoints: pc.Endpoints, env: Optional[dict] = None) -> None:
    """The learner program on this host (see the module docstring).

    On a learner of several hosts, a program that ends with a collective's failure
    (:func:`failed_collective`: a host died) exits at once with code 1: every later
    collective, the process's ``jax.distributed`` shutdown and orbax's checkpoint barriers
    included, would wait for the dead host until the launcher's SIGKILL (``STOP_GRACE_S``)
    or the coordination service's timeout. A checkpoint being written stays uncommitted
    (orbax's temporary folder), never half written; the rerun resumes from the last
    committed one.
    """
    if cfg.learner.num_hosts > 1:
        watch_for_lost_peer()
    if join_slice(cfg, env) == 0:
        from rlflow.learner.program import main
    else:
        from rlflow.learner.hosts import follower_main as main
    try:
        main(cfg, endpoints)
    except BaseException as e:
        failed = failed_collective(e) if cfg.learner.num_hosts > 1 else None
        if failed is not None:
            _leave_slice(f"a collective of the learner slice failed ({_first_line(failed)}): "
                         f"a learner host is gone")
        raise


def watch_for_lost_peer() -> None:
    """End this learner host with code 1 when the launcher signals that another host of the
    slice died (:data:`PEER_LOST_SIGNAL`, :func:`notify_lost_peer`).

    The main thread cannot act on it when it waits inside a barrier of the coordination
    service (orbax's checkpoint barriers, ``jax.distributed.shutdown``): Python runs signal
    handlers only between bytecodes of the main thread, and such a barrier waits for the
    dead host until its timeout, unlike a gloo collective, which fails at once
    (:func:`run_learner`). So the signal is read from a wakeup fd
    (``signal.set_wakeup_fd``) by a daemon thread, which logs why and exits at once. Call
    from the main thread (once). On a pod, whose hosts no single launcher starts, the
    coordination service's heartbeat timeout is what ends the others.
    """
    if _peer_watch:
        return
    read_end, write_end = socket.socketpair()
    write_end.setblocking(False)
    # a Python handler makes CPython's C handler write the signal's number to the fd
    signal.signal(PEER_LOST_SIGNAL, lambda signum, frame: None)
    signal.set_wakeup_fd(write_end.fileno(), warn_on_full_buffer=False)
    _peer_watch.extend([read_end, write_end])

    def watch() -> None:
        while True:
            data = read_end.recv(64)        # one byte per signal received, any signal
            if not data:
                return
            if int(PEER_LOST_SIGNAL) in data:
                _leave_slice("the launcher reports that another host of the learner slice "
                             "died")

    threading.Thread(target=watch, name="rlflow-lost-peer-watch", daemon=True).start()


def notify_lost_peer(procs: Mapping[str, subprocess.Popen], lost: str) -> list[str]:
    """Launcher side: send :data:`PEER_LOST_SIGNAL` to every learner host still running
    but ``lost`` (``procs``: child name -> its process, learner hosts among them).
    Returns the names signalled."""
    told = []
    for name, proc in procs.items():
        if name == lost or not name.startswith("learner") or proc.poll() is not None:
            continue
        try:
            os.kill(proc.pid, PEER_LOST_SIGNAL)
            told.append(name)
        except ProcessLookupError:
            pass
    return told


def failed_collective(error: BaseException):
    """The ``jax.errors.JaxRuntimeError`` that ``error`` is, or was raised from or during
    (its ``__cause__`` / ``__context__`` chain), else None: on a learner of several hosts,
    the failure of a cross-host computation (gloo on CPU: "Connection reset by peer")."""
    import jax

    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, jax.errors.JaxRuntimeError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def leave_background_compiles(code: int) -> None:
    """End the process with ``code`` now when the only threads still running are the
    learner's background compiles of the train step (the worst-case packed shape,
    :meth:`rlflow.learner.trainer.Learner.compiled_step`); else return (a normal exit).

    The program is done, so nothing will use them, and an XLA compile cannot be interrupted:
    the interpreter would wait for it (1-10 s on CPU; a learner host that compiles without
    the persistent cache hit, host 1.. of a CPU slice, waits the longest). The threads are
    not daemons because CPython would end a daemon thread inside the compile at
    finalisation and abort the process. ``jax.distributed`` is shut down first (a learner
    of several hosts: every host reaches it at the end of the run).
    """
    trainer = sys.modules.get("rlflow.learner.trainer")
    running = [t for t in threading.enumerate()
               if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if trainer is None or not running or any(t.name != trainer.COMPILE_THREAD_NAME
                                             for t in running):
        return
    import jax

    jax.distributed.shutdown()          # no-op on a learner of one host
    log.info("exiting without waiting for %d background compile(s) of the train step",
                len(running))
    _exit_now(code)


def _exit_now(code: int) -> None:
    """Flush the logs and end the process with ``code``, skipping atexit handlers
    (``jax.distributed.shutdown``) and the joins of non-daemon threads."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]
