"""The gateway demo's agent (configs/agents/gateway_demo_agent.py) against a scripted
gateway on the demo task's tokenizer: its answers come back as ``guess`` tool calls (the
parser plug-in), the tool's result is rendered as a user turn (the 20-token vocabulary), the
reward is guess_digit's, and the episode is token for token what the built-in
``guess_digit`` environment's episode would be."""

import os

import numpy as np
import pytest

import gateway_fixtures as gf

pytest.importorskip("openai")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
AGENT = os.path.join(REPO, "configs", "agents", "gateway_demo_agent.py")


@pytest.mark.parametrize("answers,hidden,reward", [(["2", "4"], 4, 0.9), (["x", "3", "1"], 0, 0.0),
                                                   (["1"], 1, 1.0)])
def test_demo_agent_plays_guess_digit_through_tool_calls(tmp_path, answers, hidden, reward):
    from rlflow.data.tasks import get_task
    from rlflow.envs.chat import ChatRenderer
    from rlflow.gateway.server import GatewayServer
    from rlflow.gateway.service import Gateway
    from rlflow.gateway.sessions import SessionStore
    from rlflow.sampler.sampling import SamplingParams
    from rlflow.system import plugins

    tok = get_task("guess_digit_tools").build_tokenizer(str(tmp_path / "tok"))
    renderer = ChatRenderer(tok)
    store = SessionStore(renderer, max_prompt_tokens=32, max_episode_tokens=16,
                         max_call_tokens=16)
    calls = gf.ScriptedCalls(renderer, answers)
    gateway = Gateway(store, calls, SamplingParams(max_tokens=16),
                      tool_parser=f"{AGENT}:parse_guess")
    server = GatewayServer(gateway, gf.KEY)
    try:
        session = store.open()
        agent = plugins.resolve(f"{AGENT}:agent")
        got = agent(gf.client(server, session.id), {"prompt_id": 0, "prompt": "?",
                                                    "answer": str(hidden)})
        assert got == pytest.approx(reward)
        ep = session.episode()
        assert tok.decode(ep["prompt"].tolist()) == "<bos><|user|>?<eos><|assistant|>"
        # the episode as the guess_digit environment renders it: "d<eos>" sampled, then
        # "<|user|>+<eos><|assistant|>" (the tool result) with no loss
        text = tok.decode(np.concatenate([ep["prompt"], ep["tokens"]]).tolist())
        assert text.count("<|tool|>") == 0 and store.counts["branches"] == 0
        assert int(ep["mask"].sum()) == 2 * len(answers)
        assert store.counts["calls"] == len(answers)
        if answers == ["2", "4"]:
            assert text == "<bos><|user|>?<eos><|assistant|>2<eos><|user|>+<eos><|assistant|>4<eos>"
    finally:
        server.close()
