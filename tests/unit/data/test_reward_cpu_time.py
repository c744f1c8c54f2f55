"""Reward calls are timed by CPU time, with a wall-clock backstop (issue 49, fault 8).

``reward.timeout_s`` was wall time: on a machine at load average 9-15 the demo's
one-character ``digits_match`` ran past 5 s of wall time 1-2 times a run and a correct sample
scored 0. Now a call is cut when the worker has spent ``timeout_s`` of CPU time on it, or
when it has run :data:`rlflow.data.reward_workers.WALL_BACKSTOP_FACTOR` x ``timeout_s`` of
wall time (a call that waits: ``sleep``, a lock, I/O). A worker that gets no CPU (stopped
here with SIGSTOP, as an overloaded machine would starve it) is not cut for that.
"""

import os
import signal
import threading
import time

import pytest

from rlflow.config import RewardConfig
from rlflow.data.reward_workers import WALL_BACKSTOP_FACTOR
from rlflow.data.rewarder import Rewarder
from rlflow.data.rewards import register_reward

_release = threading.Event()


@register_reward("cpu_test_spins")
def _spins(completion, answer):
    while True:                       # pure CPU, never returns
        pass


@register_reward("cpu_test_sleeps_forever")
def _sleeps(completion, answer):
    _release.wait(120)                # no CPU; released at module teardown
    return 1.0


@register_reward("cpu_test_length")
def _length(completion, answer):
    return float(len(completion))


_made = []


@pytest.fixture(scope="module", autouse=True)
def _close_all():
    yield
    _release.set()
    for r in _made:
        r.close()


def _rewarder(name, timeout_s):
    r = Rewarder(RewardConfig(functions=(name,), weights=(1.0,), timeout_s=timeout_s,
                              num_workers=1, memory_limit_mb=0))
    _made.append(r)
    return r


def _results(pool, limit_s=300.0):
    """Poll until a result arrives (``limit_s``: a liveness bound, not a timing assertion)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        out = pool.poll(0.2)
        if out:
            return out
    raise AssertionError(f"no result after {limit_s} s")


def test_a_cpu_bound_reward_is_cut_by_cpu_time():
    r = _rewarder("cpu_test_spins", timeout_s=0.5)
    pool = r._pool
    pool.wait_ready()
    task = pool.submit(0, "x", "x")
    (got,) = _results(pool)
    assert got[:2] == (task, "timeout")
    assert got[2] == "ran past 0.5 s of CPU time", got


def test_a_sleeping_reward_is_cut_by_the_wall_clock_backstop():
    r = _rewarder("cpu_test_sleeps_forever", timeout_s=0.2)
    pool = r._pool
    assert pool.wall_timeout_s == pytest.approx(WALL_BACKSTOP_FACTOR * 0.2)
    pool.wait_ready()
    task = pool.submit(0, "x", "x")
    (got,) = _results(pool)
    assert got[:2] == (task, "timeout")
    assert got[2].startswith(f"ran past {WALL_BACKSTOP_FACTOR * 0.2:g} s of wall time"), got
    # the pool replaced the worker: the next call is scored
    assert r.score(["x"], ["x"], ["id"]).total.tolist() == [0.0]      # it sleeps again...
    assert r.failures["cpu_test_sleeps_forever"]["timeouts"] == 1     # ... and times out


def test_a_fast_reward_on_a_starved_worker_is_not_timed_out():
    """The worker is stopped (SIGSTOP) for 4 x timeout_s of wall time with a call sent to it,
    then continued: it got no CPU meanwhile, so the call is scored, not cut. (On a wall-clock
    deadline the pool reported it as a timeout while the worker was stopped.)"""
    timeout_s = 0.5
    r = _rewarder("cpu_test_length", timeout_s=timeout_s)
    pool = r._pool
    pool.wall_timeout_s = 600.0       # the backstop is not under test here
    pool.wait_ready()
    pid = pool._workers[0].process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        task = pool.submit(0, "abc", "x")
        stopped = []
        end = time.monotonic() + 4 * timeout_s
        while time.monotonic() < end:
            stopped += pool.poll(0.1)
        assert stopped == []          # a stopped worker answers nothing, and nothing is cut
    finally:
        os.kill(pid, signal.SIGCONT)
    assert _results(pool) == [(task, "ok", 3.0)]
    assert pool.restarts == 0
