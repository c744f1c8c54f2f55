"""``verifiers`` environments as gateway agents: a verifiers environment's rollout runs
against the session's OpenAI endpoint, its rubric gives the reward.

Usage (a file named in ``gateway.agent``)::

    from rlflow.gateway.verifiers_env import verifiers_agent
    agent = verifiers_agent("wordle")          # vf.load_environment("wordle")

The leased prompt's ``prompt_id`` picks the row of the environment's dataset
(``prompt_id mod len(dataset)``; the run's data set then only numbers the rows: use a builtin
source with at least as many records). Written against verifiers' rollout interface
(``await env.rollout(input, client, model, sampling_args) -> State``, then
``await env.rubric.score_rollout(state)`` sets ``state["reward"]``); a rollout that ends with
``state["error"]`` fails its session. Not exercised by the test suite where ``verifiers`` is
not installed (tests/unit/gateway/test_gateway_verifiers.py names why).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional

ROLLOUT_FIELDS = ("prompt", "answer", "task", "info", "example_id")


def verifiers_agent(env_id: str, *, model: str = "policy",
                    sampling_args: Optional[dict] = None, env=None,
                    **env_args: Any) -> Callable:
    """An agent function ``(client, task) -> reward`` that plays ``env_id``.

    Args:
      env_id: the verifiers environment (``vf.load_environment(env_id, **env_args)``).
      model: the model name sent to the gateway.
      sampling_args: extra request fields (the gateway refuses a temperature or top-p other
        than the run's).
      env: an environment object to use instead of loading ``env_id``.

    Raises:
      ImportError: verifiers is not installed (``pip install verifiers``).
    """
    if env is None:
        import verifiers as vf

        env = vf.load_environment(env_id, **env_args)
    data = env.get_dataset() if hasattr(env, "get_dataset") else env.dataset

    def agent(client, task) -> float:
        import openai

        row = dict(data[int(task["prompt_id"]) % len(data)])
        rollout_input = {k: row[k] for k in ROLLOUT_FIELDS if k in row}
        rollout_input.setdefault("example_id", int(task["prompt_id"]))

        async def run():
            aclient = openai.AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key,
                                         max_retries=0)
            try:
                state = await env.rollout(rollout_input, aclient, model, sampling_args or {})
                await env.rubric.score_rollout(state)
                return state
            finally:
                await aclient.close()

        state = asyncio.run(run())
        if state.get("error") is not None:
            raise RuntimeError(f"verifiers rollout of {env_id!r} failed: {state['error']!r}")
        return float(state.get("reward") or 0.0)

    return agent
