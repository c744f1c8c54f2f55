"""``verifiers`` environments as gateway agents: one episode of a verifiers (>= 0.4,
``verifiers.v1``) environment per gateway session; the environment's own harness plays it,
every model call goes through the session, the task's rewards score it.

Usage (a file named in ``gateway.agent``)::

    from rlflow.gateway.verifiers_env import verifiers_agent
    agent = verifiers_agent("gsm8k-v1", config={"agent": {"runtime": {"type": "docker"}}})

How a session runs (verifiers 0.4.0's own path, ``vf.load_environment`` ->
``Env.serving()`` -> ``Env.run_episode(task, ModelContext)``): the leased prompt's
``prompt_id`` picks the task (``prompt_id mod len(taskset)``; the run's data set then only
numbers the tasks: use a builtin source with at least as many records); the environment's
harness sends its model calls to verifiers' interception server, which forwards each one
(the harness's OpenAI ``/chat/completions`` body, ``model`` and ``sampling_args`` applied,
relayed by verifiers' eval client) to the session's base URL, so the gateway records the
episode's tokens as for any agent; the episode's one trace's reward (the sum of its weighted
task rewards) is the session's reward.

The run's gateway key reaches verifiers' client through this process's environment, as
``RLFLOW_GATEWAY_API_KEY`` (verifiers reads provider keys only from environment variables;
its subprocess runtime drops every variable whose name holds ``API_KEY`` from the programs it
starts, and container runtimes pass none): never argv or disk.

Limits: one trace per episode (multi-agent environments, whose judges or peers would also
call the policy through the same session, are refused); verifiers' runtime defaults to a
Prime sandbox (``prime login``): pin ``{"agent": {"runtime": {"type": "subprocess"}}}`` or
``docker`` in ``config`` to run on the sampler host.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Callable, Optional

KEY_VAR = "RLFLOW_GATEWAY_API_KEY"
_KEY_LOCK = threading.Lock()


def env_config(env_id: str, config: Optional[dict] = None) -> dict:
    """``config`` (``vf.EnvConfig`` fields as a dict) with ``taskset.id`` set to ``env_id``."""
    merged = dict(config or {})
    merged["taskset"] = {**dict(merged.get("taskset") or {}), "id": env_id}
    return merged


def _put_key(api_key: str) -> None:
    with _KEY_LOCK:
        got = os.environ.get(KEY_VAR)
        if got is not None and got != api_key:
            raise ValueError(f"{KEY_VAR} already holds another gateway's key: one run's "
                             "gateway per agent process")
        os.environ[KEY_VAR] = api_key


def verifiers_agent(env_id: str, *, model: str = "policy",
                    sampling_args: Optional[dict] = None, config: Optional[dict] = None,
                    timeout_s: Optional[float] = None) -> Callable:
    """An agent function ``(client, task) -> reward`` that plays one episode of ``env_id``.

    Args:
      env_id: the verifiers taskset id (an installed taskset package, as ``vf-eval <id>``).
      model: the model name sent to the gateway.
      sampling_args: ``vf.SamplingConfig`` fields (the gateway refuses a temperature or
        top-p other than the run's).
      config: further ``vf.EnvConfig`` fields (e.g. the agent's harness or runtime), as a
        dict; ``taskset.id`` is ``env_id``.
      timeout_s: the most seconds one episode may take (None: no limit of our own; the
        gateway still expires a session with no call for ``gateway.session_timeout_s``).

    Returns:
      ``agent(client, task) -> float``: ``client`` an ``openai.OpenAI`` bound to the session
      (``.../s/<session>/v1``, the run's key), ``task`` the leased prompt's record
      (``prompt_id`` picks the task). Each calling thread loads its own environment once
      (``Env.serving()`` holds per-environment state, so threads do not share one).

    Raises (from the agent function):
      ImportError: verifiers (>= 0.4, ``verifiers.v1``) is not installed.
      ValueError: the taskset is unbounded or empty; another gateway key in this process.
      RuntimeError: the episode failed (verifiers' errors, named) or has several traces.
      TimeoutError: the episode took longer than ``timeout_s``.
    """
    local = threading.local()

    def load():
        import verifiers.v1 as vf

        env = vf.load_environment(vf.resolve_env_config(env_config(env_id, config)))
        if not env.taskset.bounded:
            raise ValueError(f"verifiers taskset {env_id!r} is infinite: bound it in config")
        tasks = list(env.taskset)
        if not tasks:
            raise ValueError(f"verifiers taskset {env_id!r} has no tasks")
        return vf, env, tasks

    def agent(client, task) -> float:
        if not hasattr(local, "env"):
            local.vf, local.env, local.tasks = load()
        vf, env = local.vf, local.env
        vtask = local.tasks[int(task["prompt_id"]) % len(local.tasks)]
        _put_key(str(client.api_key))
        ctx = vf.ModelContext(model=model, client=vf.EvalClientConfig(
            base_url=str(client.base_url).rstrip("/"), api_key_var=KEY_VAR),
            sampling=vf.SamplingConfig(**(sampling_args or {})))

        async def run():
            async with env.serving():
                return await asyncio.wait_for(env.run_episode(vtask, ctx), timeout_s)

        episode = asyncio.run(run())
        return episode_reward(env_id, episode)

    return agent


def episode_reward(env_id: str, episode: Any) -> float:
    """The reward of a finished ``vf.Episode`` of one trace (its weighted task rewards'
    sum). Raises RuntimeError naming verifiers' errors for a failed episode or one of
    several traces."""
    if not episode.ok:
        errors = [f"{e.type}: {e.message}" for e in episode.errors]
        for trace in episode.traces:
            errors += [f"{e.type}: {e.message}" for e in trace.errors]
        raise RuntimeError(f"verifiers episode of {env_id!r} failed: {errors or 'not ok'}"
                           [:2000])
    if len(episode.traces) != 1:
        raise RuntimeError(f"verifiers episode of {env_id!r} has {len(episode.traces)} "
                           "traces: this adapter plays single-agent environments only")
    return float(episode.traces[0].reward)
