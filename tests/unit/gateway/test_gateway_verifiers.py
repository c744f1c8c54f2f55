"""Issue 52 acceptance 4, the adapter's part: a ``verifiers`` (0.4.0, ``verifiers.v1``)
environment plays a gateway session (:mod:`rlflow.gateway.verifiers_env`): its harness's
call goes through verifiers' interception server to the session, the gateway records the
episode (the prompt the harness sent, the scripted completion in the loss), the task's
reward is the session's; a failed episode raises, naming verifiers' error. The training
part (2 learner steps on these rollouts) is tests/e2e/test_gateway_verifiers_e2e.py."""

import pytest

import gateway_fixtures as gf
import verifiers_digit
from chat_fixtures import tiny_tokenizer


@pytest.fixture()
def renderer(monkeypatch):
    from rlflow.envs.chat import ChatRenderer
    from rlflow.gateway.verifiers_env import KEY_VAR

    monkeypatch.setenv(KEY_VAR, gf.KEY)       # undone after the test
    return ChatRenderer(tiny_tokenizer("chatml"))


@pytest.mark.parametrize("prompt_id,reward", [(3, 1.0), (8, 1.0), (1, 0.0)])
def test_a_verifiers_episode_runs_through_a_gateway_session(renderer, prompt_id, reward):
    server, gateway, calls = gf.scripted(renderer, ["3"])
    try:
        session = gateway.store.open()
        got = verifiers_digit.agent(gf.client(server, session.id), {"prompt_id": prompt_id})
        assert got == reward          # task prompt_id mod 5: hidden digit 3, 3, 1
        assert gateway.store.counts["calls"] == 1
        prompt = renderer.prompt_ids([{"role": "user", "content": verifiers_digit.PROMPT}])
        assert calls.prompts == [prompt]
        episode = session.episode()
        completion = renderer.encode("3") + [renderer.turn_end_id]
        assert episode["prompt"].tolist() == prompt
        assert episode["tokens"].tolist() == completion and episode["mask"].all()
        assert (episode["logprobs"] == -1.0).all() and (episode["versions"] == 7).all()
    finally:
        server.close()


def test_a_failed_verifiers_episode_raises_with_verifiers_error(renderer):
    server, gateway, calls = gf.scripted(renderer, ["3"])
    try:
        session = gateway.store.open()
        gateway.end(session, reward=0.0)             # the gateway now refuses its calls (409)
        with pytest.raises(RuntimeError, match="verifiers episode of 'verifiers_digit' "
                                               "failed:.*409"):
            verifiers_digit.agent(gf.client(server, session.id), {"prompt_id": 0})
        assert calls.prompts == [] and gateway.store.counts["calls"] == 0
    finally:
        server.close()
