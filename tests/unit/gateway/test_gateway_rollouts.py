"""Issue 52 acceptance 3 (load and failing agents): leased prompts become agent sessions run
by the agent runner process (``rlflow.gateway.agents``) against the gateway on loopback; 64
concurrent sessions give 16 groups of 4 with no lost or duplicated episode, every record valid
for the learner; an agent that crashes fails its session, one that hangs expires, and the
group still comes out (those samples marked failed, reward 0)."""

import os
import threading
import time

import numpy as np
import pytest

import gateway_fixtures as gf
from chat_fixtures import tiny_tokenizer
from rlflow.exchange.records import validate_group

pytest.importorskip("openai")

HERE = os.path.dirname(os.path.abspath(__file__))
AGENT = os.path.join(HERE, "..", "..", "gateway_agents.py") + ":agent"
GUARD_S = 240.0          # stops a broken run; not a timing assertion


class EchoCalls:
    """Answers every call with "84" + end of turn (thread-safe, no batcher)."""

    def __init__(self, renderer):
        self.ids = renderer.encode("84") + [renderer.turn_end_id]
        self.lock = threading.Lock()
        self.calls = 0

    def generate(self, prompt_ids, n, sampling, timeout_s):
        from rlflow.sampler.requests import Completion

        with self.lock:
            self.calls += 1
        ids = np.asarray(self.ids, np.int32)
        return [Completion(0, i, ids, np.full(ids.size, -0.5, np.float32),
                           np.full(ids.size, 2, np.int32), "stop") for i in range(n)]


def _run(prompts, group_size, *, threads, session_timeout_s, max_tokens=48):
    """Admit ``prompts`` ({"prompt_id", "prompt", "answer"}), run the agent runner until
    every group is out; returns (groups, dropped, rollouts, store)."""
    from rlflow.envs.chat import ChatRenderer
    from rlflow.gateway.agents import start_runner
    from rlflow.gateway.rollouts import GatewayRollouts
    from rlflow.gateway.server import GatewayServer
    from rlflow.gateway.service import Gateway
    from rlflow.gateway.sessions import SessionStore
    from rlflow.sampler.sampling import SamplingParams

    renderer = ChatRenderer(tiny_tokenizer("chatml"))
    store = SessionStore(renderer, max_prompt_tokens=512, max_episode_tokens=max_tokens,
                         max_call_tokens=16)
    gateway = Gateway(store, EchoCalls(renderer), SamplingParams(max_tokens=16))
    rollouts = GatewayRollouts(gateway, group_size, max_tokens, session_timeout_s)
    server = GatewayServer(gateway, gf.KEY, next_session=rollouts.next_session)
    requests = [rollouts.admit(p["prompt_id"], p) for p in prompts]
    runner = start_runner(server.base_url, gf.KEY, AGENT, threads)
    groups, dropped = [], []
    try:
        start = time.monotonic()
        while rollouts.in_flight and time.monotonic() - start < GUARD_S:
            got, lost = rollouts.poll()
            groups += got
            dropped += lost
            time.sleep(0.05)
    finally:
        runner.terminate()
        runner.wait(timeout=30)
        server.close()
    assert not rollouts.in_flight, "the groups did not all come out (hang guard)"
    assert {id(g.request) for g in groups} | {id(r) for r in dropped} == \
        {id(r) for r in requests}
    return groups, dropped, rollouts, store, len(gateway.calls.ids)


def test_64_concurrent_sessions_no_lost_or_duplicated_episode():
    prompts = [{"prompt_id": i, "prompt": "ok", "answer": ""} for i in range(16)]
    groups, dropped, rollouts, store, turn = _run(prompts, 4, threads=64,
                                                  session_timeout_s=120.0)
    assert not dropped and len(groups) == 16
    assert sorted(g.prompt_id for g in groups) == list(range(16))
    seen = set()
    for g in groups:
        record = g.to_record()
        validate_group(record, group_size=4, max_tokens=48)
        # each of the 4 episodes: 3 sampled turns of "84<|im_end|>", reward from the agent
        assert (record["loss_mask"].sum(axis=1) == 3 * turn).all()
        np.testing.assert_allclose(record["rewards"], 1.0 + g.prompt_id / 1000, rtol=1e-6)
        assert "failed" not in record
        for c in g.completions:
            seen.add(c.tokens.tobytes() + bytes([g.prompt_id, c.sample_index]))
    assert len(seen) == 64
    c = store.counts
    assert c["sessions_opened"] == 64 and c["sessions_ended"] == 64 and c["calls"] == 192
    assert c["branches"] == 0 and rollouts.counts["sessions_handed_out"] == 64
    assert store.metrics()["gateway/sessions_open"] == 0


def test_crashing_and_hanging_agents_fail_their_sessions_and_the_group_comes_out():
    prompts = [{"prompt_id": 7, "prompt": "crash", "answer": ""},
               {"prompt_id": 8, "prompt": "hang", "answer": ""},
               {"prompt_id": 9, "prompt": "ok", "answer": ""}]
    groups, dropped, rollouts, store, turn = _run(prompts, 2, threads=6,
                                                  session_timeout_s=3.0)
    by_id = {g.prompt_id: g.to_record() for g in groups}
    assert sorted(by_id) == [7, 8, 9] and not dropped
    for pid in (7, 8):
        rec = by_id[pid]
        validate_group(rec, group_size=2, max_tokens=48)
        assert rec["failed"].all() and (rec["rewards"] == 0).all()
        assert (rec["loss_mask"].sum(axis=1) == turn).all()    # the one call they made
    assert "failed" not in by_id[9] and (by_id[9]["rewards"] > 1).all()
    assert store.counts["sessions_failed"] == 2 and store.counts["sessions_expired"] == 2
