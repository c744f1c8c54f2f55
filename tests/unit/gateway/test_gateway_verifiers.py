"""Issue 52 acceptance 5: a ``verifiers`` environment's rollouts through the gateway
(:mod:`rlflow.gateway.verifiers_env`). Skipped where verifiers is not installed: the shared
test environment does not carry it (verifiers 0.4.0 installs on its own, but not beside
openenv, and adding it would change the environment's pinned packages)."""

import pytest

import gateway_fixtures as gf
from chat_fixtures import tiny_tokenizer

vf = pytest.importorskip(
    "verifiers", reason="verifiers is not installed in the test environment (it cannot be "
    "installed beside openenv, and installing it would change the pinned packages)")


def test_a_verifiers_single_turn_env_scores_a_gateway_session():
    from datasets import Dataset

    from rlflow.envs.chat import ChatRenderer
    from rlflow.gateway.verifiers_env import verifiers_agent

    def exact(completion, answer, **kw):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        return 1.0 if text.strip() == answer else 0.0

    env = vf.SingleTurnEnv(dataset=Dataset.from_list([
        {"question": "What is 12 times 7?", "answer": "84"}]), rubric=vf.Rubric(funcs=[exact]))
    renderer = ChatRenderer(tiny_tokenizer("chatml"))
    server, gateway, calls = gf.scripted(renderer, ["84"])
    try:
        session = gateway.store.open()
        agent = verifiers_agent("inline", env=env)
        reward = agent(gf.client(server, session.id), {"prompt_id": 0})
        assert reward == 1.0 and gateway.store.counts["calls"] == 1
        assert int(session.episode()["mask"].sum()) == len(renderer.encode("84")) + 1
    finally:
        server.close()
