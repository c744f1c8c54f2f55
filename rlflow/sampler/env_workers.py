"""Environment worker processes: each ``Environment.step`` runs in a killable process.

The pool is :class:`rlflow.data.reward_workers.WorkerPool` (spawned workers in their own
process groups, a wall-clock deadline per call, kill and replace on a timeout or a death)
with this module's entry point. A call takes the episode's environment object (pickled) and
the assistant text, and returns ``(EnvStep, environment)``: the environment's state travels
with the call, so any worker can run any episode's next step, and a worker killed for a
timeout loses nothing but that episode (which then ends with reward 0, counted).

No JAX here: a worker imports only the plugins, :mod:`rlflow.envs` (the built-in
environments) and the configured environment's module.
"""

from __future__ import annotations

import os
from typing import Sequence

from rlflow.data.reward_workers import WorkerPool, new_process_group, serve


class EnvWorkerError(RuntimeError):
    """Environment workers cannot start (a plugin or the environment fails to load)."""


def _step(env, assistant: str):
    return env.step(assistant), env


def env_worker_main(conn, plugins: Sequence[str], env_name: str) -> None:
    """Worker entry point: import plugins and the environment, report ready, then serve
    ``(task_id, env, assistant_text)`` calls with ``(EnvStep, env)``."""
    new_process_group()
    try:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")   # a plugin importing JAX: no accelerator
        from rlflow.envs import get_environment
        from rlflow.system.plugins import import_plugins

        import_plugins(plugins)
        get_environment(env_name)           # imports a "module:function" environment here
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    serve(conn, _step, 0, "env")


def env_pool(env_cfg, plugins: Sequence[str] = ()) -> WorkerPool:
    """``env.num_workers`` environment workers, ``env.step_timeout_s`` of wall time per step
    (not CPU time, as rewards: a step may wait on a tool's subprocess or a service)."""
    return WorkerPool(env_worker_main, (tuple(plugins), env_cfg.name),
                      num_workers=env_cfg.num_workers, timeout_s=env_cfg.step_timeout_s,
                      what="env", error=EnvWorkerError, clock="wall")
