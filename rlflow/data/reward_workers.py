"""Reward worker processes: every reward call bounded in time and memory.

A reward function is user code: it may loop, hold the GIL (``10**10**9``: a big-integer
power never releases it, so a thread-based timeout cannot even get control back) or
allocate without bound. Math graders therefore run each check in a process that can be
killed; so does rlflow. :class:`RewardWorkerPool` keeps ``reward.num_workers`` processes
(``spawn`` context: never a fork of a process whose JAX runtime is running), each of which

  * imports ``plugins`` and the reward functions and warms them up (math-verify's imports
    and first parse) before it reports ready: start-up never counts against a timeout,
  * then limits its address space (``RLIMIT_AS``) to what it maps at that point plus
    ``reward.memory_limit_mb``: a call allocating more gets ``MemoryError``, scored 0 and
    counted as an error,
  * then scores one sample at a time, in the order they were sent to it.

Each worker runs in its own process group. A reward call is timed by **CPU time**: once the
worker has spent ``reward.timeout_s`` seconds of CPU (user + system, ``/proc/<pid>/stat``) on
it since it started (the worker received it, or finished its previous call), it is
abandoned: the worker's group is killed (SIGKILL: the worker and any process the call
started), the sample scores 0 (counted as a timeout) and a new worker is started in the
background. CPU time, not wall time, because a loaded host stretches wall time: at load
average 9-15 on 2 cores a one-character ``digits_match`` call ran past 5 s of wall time and
a correct sample scored 0. A call that waits instead of computing (``sleep``, a lock, I/O, a
subprocess it waits on: a child's CPU counts only once waited for) is cut by the wall-clock
backstop, :data:`WALL_BACKSTOP_FACTOR` x ``reward.timeout_s`` after it started. Where CPU time
cannot be read (no ``/proc``) the call gets ``timeout_s`` of wall time. A pool can time its
calls by wall time alone (``clock="wall"``: the environment workers, whose steps may wait on
a tool's subprocess). A worker that dies (e.g. killed by the OS) scores its sample 0 as an error and
is replaced the same way. Calls sent to a killed worker that had not started go back to the
head of the queue.

A reward pool keeps up to ``calls_per_worker`` calls (default 16) queued in each worker's
pipe, so a worker goes from one sample to the next without waiting for the sampler's loop
to come back to :meth:`WorkerPool.poll`: with one call per worker, a sampler whose decode
call takes ~10 ms scored ``num_workers`` samples per decode call at most, and the rewards,
not the decoding, bounded its throughput (``benchmarks/async_vs_sync.py``).

The pool is non-blocking: :meth:`RewardWorkerPool.submit` queues samples and
:meth:`RewardWorkerPool.poll` dispatches queued samples to idle workers and returns the
results that arrived (waiting at most its ``timeout``), so the sampler decodes while rewards
are computed.

The machinery (spawned workers in their own process groups, per-call deadlines, kill and
replace) is :class:`WorkerPool`, parametrised by the worker's entry point; the sampler's
environment workers (:mod:`rlflow.sampler.env_workers`) use it too. A worker entry point
loads what it needs, reports ``("ready", None)`` or ``("failed", message)`` on its pipe,
then calls :func:`serve` with its per-call handler.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import wait as wait_connections
from typing import List, Optional, Sequence, Tuple

from rlflow.system.process_limits import (exit_text, kill_process_group, own_cpu_s,
                                           process_cpu_s, set_memory_limit)

logger = logging.getLogger(__name__)

#: Seconds a new worker may take to import and warm up before the pool gives up on it.
STARTUP_TIMEOUT_S = 300.0

#: A CPU-timed call (``clock="cpu"``) is cut after this many times its timeout of wall time
#: too, whatever CPU it used: the backstop for a call that waits (sleep, lock, I/O) instead
#: of computing. Generous, so that only a call that really hangs reaches it on a loaded host
#: (a process given 1/10 of a core still gets its timeout's worth of CPU before it).
WALL_BACKSTOP_FACTOR = 10.0

#: Least wall time between two readings of a busy worker's CPU time (seconds).
_MIN_CPU_CHECK_S = 0.02

# A result: (task id, "ok" | "error" | "timeout", value or message)
Result = Tuple[int, str, object]


def serve(conn, handle, memory_limit_mb: int = 0, what: str = "reward") -> None:
    """A worker's call loop: ``(task_id, *args)`` in -> :data:`Result` out, until ``None``,
    EOF or a reset connection (the parent died, e.g. ``kill -9``: the worker leaves
    quietly rather than write a traceback into the parent's log, where it reads as the
    parent's own error). ``handle(*args)`` gives the value; an exception (``MemoryError``
    past the limit included) is sent as ``"error"`` with its text."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, ConnectionError, KeyboardInterrupt):
            return
        if msg is None:
            return
        task_id, args = msg[0], msg[1:]
        try:
            out = (task_id, "ok", handle(*args))
        except MemoryError:
            out = (task_id, "error", f"MemoryError: past {what}.memory_limit_mb="
                                     f"{memory_limit_mb}")
        except BaseException as e:  # noqa: BLE001 - a failed call is reported, counted
            out = (task_id, "error", f"{type(e).__name__}: {e}")
        # when the call ended (CLOCK_MONOTONIC, the same clock in every process) and this
        # process's CPU time then: the next call queued in this worker started at that point,
        # and its wall and CPU budgets count from it
        try:
            conn.send(out + (time.monotonic(), own_cpu_s()))
        except ConnectionError:                 # BrokenPipeError / reset: the parent is gone
            return


def new_process_group() -> None:
    """Make the calling worker the leader of its own process group (a kill reaches what a
    call starts). No PR_SET_PDEATHSIG: it fires when the *thread* that started the worker
    ends, and a pool may be driven from a short-lived thread; an idle worker exits on EOF
    when its parent dies."""
    with contextlib.suppress(OSError):
        os.setpgrp()


def _worker_main(conn, plugins: Sequence[str], functions: Sequence[Tuple[str, str]],
                 memory_limit_mb: int) -> None:
    """Worker process: set limits, load and warm up the functions, then score on request.

    ``functions``: (registry name or ``module:attr``, module that registered it) pairs.
    Messages in: ``(task_id, function index, completion, answer, finish_reason)`` or None
    (stop).
    Messages out: ``("ready", None)`` / ``("failed", message)`` once, then :data:`Result`.
    """
    new_process_group()
    try:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")   # a plugin importing JAX: no accelerator
        from rlflow.data import rewards
        from rlflow.system.plugins import import_module, import_plugins

        import_plugins(plugins)
        fns = []
        for name, module in functions:
            if not rewards.is_available(name) and module:
                import_module(module)                    # its @register_reward runs here
            fns.append(rewards.get_reward(name))
        rewards.warm_up([name for name, _ in functions])
        set_memory_limit(memory_limit_mb)                # after the imports: they are not
        conn.send(("ready", None))                       # what the limit is for
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    serve(conn, lambda index, completion, answer, finish_reason: rewards.reward_value(
        rewards.call_reward(fns[index], completion, answer, finish_reason)),
        memory_limit_mb, "reward")


@contextlib.contextmanager
def _main_not_rerun():
    """Hide ``__main__``'s file and spec while a worker is spawned: ``spawn`` would run the
    parent's main script again in the worker (a training script, ``python -m`` module or
    notebook has no business running there; the worker needs only rlflow and plugins)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class _Worker:
    def __init__(self, ctx, target, args, name):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child,) + args, daemon=True,
                                   name=name)
        with _main_not_rerun():
            self.process.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.calls: collections.deque = collections.deque()   # sent, not answered (in order)
        self.deadline = 0.0                # when the first of ``calls`` must have answered
        self.cpu_start = None              # the worker's CPU seconds when that call started
        self.check_at = math.inf           # when its CPU time is read next (clock "cpu")

    def kill(self) -> None:
        """SIGKILL the worker's process group (the worker and any process a reward call
        started, e.g. a ``sleep`` or a grader subprocess), then the worker itself (in case
        it had not made its group yet)."""
        kill_process_group(self.process.pid)   # no such group yet: the worker kill below
        try:
            self.process.kill()
            self.process.join(timeout=5.0)
        except Exception:  # noqa: BLE001
            pass
        self.conn.close()

    def exit_text(self) -> str:
        """``exit code N`` / ``killed by SIGNAME`` of a worker that died (waits for it)."""
        self.process.join(timeout=5.0)
        return exit_text(self.process.exitcode)


def _has_data(conn) -> bool:
    try:
        return conn.poll(0)
    except (EOFError, OSError):
        return True                 # let _receive see the dead worker


class RewardWorkerError(RuntimeError):
    """Reward workers cannot start (a plugin or function fails to load in them)."""


class WorkerPool:
    """``num_workers`` worker processes running ``target(conn, *args)``; see the module
    docstring.

    Args:
      target: the worker entry point (module level, importable in a spawned process).
      args: its arguments after the pipe (picklable).
      num_workers: processes (>= 1).
      timeout_s: seconds a call may run before its worker is killed ("timeout"): CPU
        seconds of the worker with ``clock="cpu"``, wall seconds with ``clock="wall"``.
      what: the workers' kind in messages and process names ("reward", "env").
      error: the exception raised when workers cannot start.
      calls_per_worker: calls sent ahead into each worker's pipe (>= 1); a worker runs them
        one after the other, each with its own ``timeout_s``.
      clock: "cpu" (a call is cut at ``timeout_s`` of the worker's CPU time, or at
        ``wall_timeout_s`` of wall time) or "wall" (at ``timeout_s`` of wall time).
      wall_timeout_s: the wall-clock backstop of ``clock="cpu"``, seconds (None:
        :data:`WALL_BACKSTOP_FACTOR` x ``timeout_s``).

    Raises:
      ValueError: ``num_workers`` or ``calls_per_worker`` below 1, ``clock`` not "cpu" or
        "wall".
    """

    def __init__(self, target, args: tuple, num_workers: int = 2, timeout_s: float = 5.0,
                 what: str = "worker", error=RuntimeError, calls_per_worker: int = 1,
                 clock: str = "cpu", wall_timeout_s: Optional[float] = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if calls_per_worker < 1:
            raise ValueError(f"calls_per_worker must be >= 1, got {calls_per_worker}")
        if clock not in ("cpu", "wall"):
            raise ValueError(f"clock must be 'cpu' or 'wall', got {clock!r}")
        self.calls_per_worker = int(calls_per_worker)
        self.timeout_s = float(timeout_s)
        self.clock = clock
        self.wall_timeout_s = (self.timeout_s if clock == "wall" else
                               float(wall_timeout_s) if wall_timeout_s is not None else
                               WALL_BACKSTOP_FACTOR * self.timeout_s)
        self.what, self._error = what, error
        self._ctx = mp.get_context("spawn")
        self._target, self._args = target, tuple(args)
        self._workers: List[_Worker] = [self._new_worker() for _ in range(num_workers)]
        self._queue: collections.deque = collections.deque()
        self._next_id = 0
        self.restarts = 0

    def _new_worker(self) -> _Worker:
        return _Worker(self._ctx, self._target, self._args, f"rlflow-{self.what}-worker")

    def submit_call(self, *args) -> int:
        """Queue one call ``handle(*args)`` in a worker; returns its task id (increasing)."""
        task_id = self._next_id
        self._next_id += 1
        self._queue.append((task_id,) + args)
        return task_id

    @property
    def pending(self) -> int:
        """Calls queued or running."""
        return len(self._queue) + sum(len(w.calls) for w in self._workers)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Block until every worker has loaded and warmed up its functions.

        Raises:
          the pool's ``error``: a worker failed to start (the message has its error).
        """
        deadline = time.monotonic() + timeout_s
        while not all(w.ready for w in self._workers):
            self.poll(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
            if time.monotonic() > deadline:
                raise self._error(f"{self.what} workers not ready after {timeout_s:.0f} s")

    def poll(self, timeout: float = 0.0) -> List[Result]:
        """Dispatch queued calls to idle workers; return the results that arrived, waiting
        at most ``timeout`` seconds for the first one (0: do not wait).

        Raises:
          the pool's ``error``: a worker could not start (load its functions).
        """
        results: List[Result] = []
        end = time.monotonic() + timeout
        while True:
            self._dispatch()
            now = time.monotonic()
            busy = [w for w in self._workers if w.calls or not w.ready]
            deadlines = [min(w.deadline, w.check_at) for w in busy if w.calls]
            wait_s = max(0.0, min([end - now] + [d - now for d in deadlines]))
            ready = wait_connections([w.conn for w in busy], wait_s) if busy else []
            if not busy and wait_s > 0 and not results:
                time.sleep(min(wait_s, 0.01))
            for i, w in enumerate(list(self._workers)):
                if w.conn in ready:     # every answer waiting in the pipe, not just one
                    results.extend(self._receive(i, w))
                    while self._workers[i] is w and w.calls and _has_data(w.conn):
                        results.extend(self._receive(i, w))
            now = time.monotonic()
            for i, w in enumerate(list(self._workers)):
                why = self._overrun(w, now) if w.calls else None
                if why:
                    results.append((w.calls[0][0], "timeout", why))
                    w.calls.popleft()
                    self._replace(i)
                elif not w.ready and now - w.started > STARTUP_TIMEOUT_S:
                    raise self._error(f"a {self.what} worker did not start within "
                                      f"{STARTUP_TIMEOUT_S:.0f} s")
            if results or time.monotonic() >= end:
                self._dispatch()
                return results

    def close(self) -> None:
        """Stop the workers (idle ones exit; busy ones are killed), and what their calls
        left running in their process groups."""
        for w in self._workers:
            try:
                if not w.calls and w.ready:
                    w.conn.send(None)
                    w.process.join(timeout=2.0)
            except Exception:  # noqa: BLE001
                pass
            w.kill()        # busy ones, and what any reward call left running in the group
        self._workers = []

    # ------------------------------------------------------------------ internals
    def _start_call(self, w: _Worker, now: float, cpu_s: Optional[float]) -> None:
        """The first of ``w.calls`` started at ``now`` (monotonic) with the worker at
        ``cpu_s`` CPU seconds (None: unknown; the call then gets ``timeout_s`` of wall)."""
        if self.clock == "wall" or cpu_s is None:
            w.deadline, w.cpu_start, w.check_at = now + self.timeout_s, None, math.inf
        else:
            # CPU time cannot pass timeout_s before as much wall time has (one thread)
            w.deadline, w.cpu_start = now + self.wall_timeout_s, cpu_s
            w.check_at = now + self.timeout_s

    def _overrun(self, w: _Worker, now: float) -> Optional[str]:
        """Why the running call of ``w`` is past its budget (None: it is not)."""
        if now >= w.deadline:
            if w.cpu_start is None:
                return f"ran past {self.timeout_s:g} s"
            return (f"ran past {self.wall_timeout_s:g} s of wall time (the backstop of a "
                    f"call timed by CPU time, {self.timeout_s:g} s: it was waiting, "
                    "not computing)")
        if now < w.check_at:
            return None
        cpu_s = process_cpu_s(w.process.pid)
        if cpu_s is None:                       # gone: its pipe's EOF reports it
            w.check_at = now + _MIN_CPU_CHECK_S
            return None
        used = cpu_s - w.cpu_start
        if used >= self.timeout_s:
            return f"ran past {self.timeout_s:g} s of CPU time"
        w.check_at = now + max(self.timeout_s - used, _MIN_CPU_CHECK_S)
        return None

    def _dispatch(self) -> None:
        for w in self._workers:
            while self._queue and w.ready and len(w.calls) < self.calls_per_worker:
                task = self._queue.popleft()
                if not w.calls:                 # an idle worker starts it now
                    self._start_call(w, time.monotonic(), process_cpu_s(w.process.pid)
                                     if self.clock == "cpu" else None)
                w.conn.send(task)
                w.calls.append(task)

    def _receive(self, i: int, w: _Worker) -> List[Result]:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            code = w.exit_text()
            out = []
            if w.calls:
                out.append((w.calls.popleft()[0], "error", f"{self.what} worker died ({code})"))
            elif not w.ready:
                raise self._error(f"a {self.what} worker died while starting ({code})")
            self._replace(i)
            return out
        if not w.ready:
            if msg[0] == "failed":
                raise self._error(f"a {self.what} worker could not start: {msg[1]}")
            w.ready = True
            return []
        w.calls.popleft()
        if w.calls:                             # the next call started when this one ended
            self._start_call(w, msg[3], msg[4])
        return [msg[:3]]

    def _replace(self, i: int) -> None:
        # calls sent to this worker that had not started go back to the head of the queue
        self._queue.extendleft(reversed(self._workers[i].calls))
        self._workers[i].kill()
        self._workers[i] = self._new_worker()
        self.restarts += 1


class RewardWorkerPool(WorkerPool):
    """``num_workers`` reward processes; see the module docstring.

    Args:
      functions: (name, registering module) per reward function; calls name them by index.
      plugins: modules each worker imports first (the ``plugins`` config field).
      num_workers: processes (>= 1).
      timeout_s: CPU seconds a call may use before its worker is killed (reward 0,
        "timeout"); a call is also killed :data:`WALL_BACKSTOP_FACTOR` x ``timeout_s`` of
        wall time after it started (see the module docstring).
      memory_limit_mb: address-space limit of each worker (0: none).
      calls_per_worker: calls queued ahead in each worker (see the module docstring).
    """

    def __init__(self, functions: Sequence[Tuple[str, str]], plugins: Sequence[str] = (),
                 num_workers: int = 2, timeout_s: float = 5.0, memory_limit_mb: int = 0,
                 calls_per_worker: int = 16):
        super().__init__(_worker_main, (tuple(plugins), tuple(functions), int(memory_limit_mb)),
                         num_workers=num_workers, timeout_s=timeout_s, what="reward",
                         error=RewardWorkerError, calls_per_worker=calls_per_worker)

    def submit(self, index: int, completion: str, answer: str,
               finish_reason: str = "stop") -> int:
        """Queue one call of function ``index`` (``finish_reason``: "stop" / "length",
        passed to a function that takes it); returns its task id (increasing)."""
        return self.submit_call(index, completion, answer, finish_reason)
