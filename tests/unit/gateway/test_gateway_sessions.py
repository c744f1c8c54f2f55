"""Issue 52 acceptance 2 and 3 over a scripted backend (each call answers the next scripted
text): tool calls parsed into OpenAI ``tool_calls`` and sent back; a 5-call session records
each generated token once (the re-sent history reuses the recorded ids); an altered history
is a counted branch sharing the ids up to the last matching turn; bad input gets one clear
HTTP error each and the session goes on."""

import json
import threading

import httpx
import numpy as np
import pytest

import gateway_fixtures as gf
from chat_fixtures import tiny_tokenizer

openai = pytest.importorskip("openai")

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(12*7)"}}\n</tool_call>'
TEXTS = [CALL, "84", CALL, "The answer is 84.", "#### 84", "84 84", "tool"]


@pytest.fixture(scope="module")
def renderer():
    from rlflow.envs.chat import ChatRenderer

    return ChatRenderer(tiny_tokenizer("chatml"))


def _first():
    return [{"role": "system", "content": gf.SYSTEM},
            {"role": "user", "content": "What is 12 times 7?"}]


def _five_calls(client, messages):
    """Five calls; after each, the assistant message goes back with a tool result."""
    out = []
    for k in range(5):
        r = client.chat.completions.create(model="m", messages=messages, tools=gf.TOOLS)
        msg = r.choices[0].message
        out.append(r)
        messages.append(msg.model_dump(exclude_none=True))
        if msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                             "content": "84"})
        else:
            messages.append({"role": "user", "content": f"go on {k}"})
    return out


def test_five_calls_record_each_token_once_and_tool_calls_round_trip(renderer):
    server, gateway, calls = gf.scripted(renderer, TEXTS)
    try:
        session = gateway.store.open()
        client = gf.client(server, session.id)
        messages = _first()
        out = _five_calls(client, messages)
        first = out[0].choices[0]
        assert first.finish_reason == "tool_calls" and first.message.content is None
        assert first.message.tool_calls[0].function.name == "python"
        assert json.loads(first.message.tool_calls[0].function.arguments) == \
            {"code": "print(12*7)"}
        assert out[1].choices[0].message.content == "84" and \
            out[1].choices[0].finish_reason == "stop"
        sampled = [renderer.encode(t) + [renderer.turn_end_id] for t in TEXTS[:5]]
        ep = session.episode()
        # each generated token recorded once, in order, with its logprob and version
        assert ep["tokens"][ep["mask"]].tolist() == sum(sampled, [])
        assert (ep["logprobs"][ep["mask"]] == -1.0).all() and (ep["versions"][ep["mask"]] == 7).all()
        assert int(ep["mask"].sum()) == gateway.store.counts["sampled_tokens"]
        # every call's prompt is the previous call's prompt + its sampled ids + the new
        # messages' continuation: recorded ids reused, never re-tokenized
        full = np.concatenate([ep["prompt"], ep["tokens"]]).tolist()
        for k in range(1, 5):
            prev = calls.prompts[k - 1] + sampled[k - 1]
            assert calls.prompts[k][:len(prev)] == prev
            assert full[:len(calls.prompts[k])] == calls.prompts[k]
        c = gateway.store.counts
        assert c["calls"] == 5 and c["branches"] == 0 and len(session.trajectories) == 1
        assert c["reused_tokens"] == sum(len(calls.prompts[k]) + len(sampled[k]) for k in range(4))
        # the tool result is rendered (mask 0) as the template's tool response
        text = renderer.tokenizer.decode(ep["tokens"][~ep["mask"]].tolist())
        assert "<tool_response>\n84\n</tool_response>" in text

        # an altered history (the second user turn edited): a branch that shares the ids
        # through the last matching sampled turn, counted; the head moves to it
        edited = messages[:6]
        assert edited[5]["role"] == "user"
        edited[5] = {"role": "user", "content": "something else"}
        before = len(calls.prompts)
        client.chat.completions.create(model="m", messages=edited, tools=gf.TOOLS)
        assert c["branches"] == 1 and c["branches_from_root"] == 0
        assert len(session.trajectories) == 2 and session.head == 1
        branch_prompt = calls.prompts[before]
        shared = calls.prompts[1] + sampled[1]    # through turn 2's sampled ids
        assert branch_prompt[:len(shared)] == shared
        assert branch_prompt[len(shared):] != calls.prompts[2][len(shared):]
        assert c["reused_tokens"] == sum(len(calls.prompts[k]) + len(sampled[k])
                                         for k in range(4)) + len(shared)
        # a changed system message: nothing matches, a branch from the root
        rooted = [{"role": "system", "content": "Another system."}] + messages[1:4]
        client.chat.completions.create(model="m", messages=rooted, tools=gf.TOOLS)
        assert c["branches"] == 2 and c["branches_from_root"] == 1
        # ending: tokens of the trajectories other than the head are counted
        gateway.end(session, reward=1.0)
        assert session.status == "ended" and c["tokens_off_head"] > 0
    finally:
        server.close()


def _post(server, path, body=b"{}", key=gf.KEY, headers=None):
    h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    h.update(headers or {})
    return httpx.post(server.base_url + path, content=body, headers=h, timeout=30)


def test_bad_input_gets_one_clear_error_each_and_the_session_goes_on(renderer):
    server, gateway, calls = gf.scripted(renderer, ["ok"] * 4, max_episode_tokens=64)
    try:
        session = gateway.store.open()
        path = f"/s/{session.id}/v1/chat/completions"
        good = json.dumps({"model": "m", "messages": _first()}).encode()
        r = _post(server, path, b'{"model": "m", "messages": [')
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = _post(server, path, good, key="wrong-key")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = _post(server, "/s/0123456789abcdef/v1/chat/completions", good)
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_session"
        r = _post(server, "/v1/chat/completions", good)
        assert r.status_code == 400 and r.json()["error"]["code"] == "missing_session"
        r = _post(server, path, json.dumps({"messages": _first(), "temperature": 0.2}).encode())
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        r = _post(server, path, json.dumps({"messages": "hi"}).encode())
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = _post(server, path, json.dumps({"messages": _first(), "tool_choice": "required"})
                  .encode())
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        long = [{"role": "user", "content": "What is 12 times 7? " * 80}]
        r = _post(server, path, json.dumps({"messages": long}).encode())
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "at most 1024 tokens" in r.json()["error"]["message"]
        r = _post(server, path, b"x" * (server.max_request_bytes + 1))
        assert r.status_code == 413
        # the official client sees the same errors as its typed exceptions
        client = gf.client(server, session.id)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.session_url(session.id), api_key="nope",
                          max_retries=0).chat.completions.create(model="m", messages=_first())
        with pytest.raises(openai.NotFoundError):
            gf.client(server, "f" * 16).chat.completions.create(model="m", messages=_first())
        # nothing was recorded by the refused calls; the session still works
        assert calls.prompts == [] and session.trajectories == []
        r = client.chat.completions.create(model="m", messages=_first())
        assert r.choices[0].message.content == "ok"
        # a continuation that leaves no room in the episode (64 tokens after the prompt)
        more = _first() + [r.choices[0].message.model_dump(exclude_none=True),
                           {"role": "user", "content": "What is 12 times 7? " * 10}]
        with pytest.raises(openai.BadRequestError, match="at most 64"):
            client.chat.completions.create(model="m", messages=more)
        assert len(session.trajectories) == 1 and gateway.store.counts["calls"] == 1
        # a closed session refuses further calls (409) and its reward cannot be posted twice
        assert _post(server, f"/rlflow/v1/sessions/{session.id}/end",
                     b'{"reward": 0.5}').json()["status"] == "ended"
        r = _post(server, path, good)
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_closed"
        r = _post(server, f"/rlflow/v1/sessions/{session.id}/end", b'{"reward": 1.0}')
        assert r.status_code == 409 and session.reward == 0.5
        r = _post(server, "/rlflow/v1/sessions/nope/end", b'{"reward": 1.0}')
        assert r.status_code == 404
        assert gateway.store.counts["refused_calls"] >= 12
    finally:
        server.close()


def test_a_call_the_sampler_never_answers_times_out_with_504(renderer):
    from rlflow.gateway.calls import CallQueue
    from rlflow.gateway.server import GatewayServer
    from rlflow.gateway.service import Gateway
    from rlflow.gateway.sessions import SessionStore
    from rlflow.sampler.sampling import SamplingParams

    store = SessionStore(renderer, max_prompt_tokens=512, max_episode_tokens=64,
                         max_call_tokens=8)
    gateway = Gateway(store, CallQueue(), SamplingParams(max_tokens=8), call_timeout_s=0.2)
    server = GatewayServer(gateway, gf.KEY)             # no batcher pumps the queue
    try:
        s = store.open()
        r = _post(server, f"/s/{s.id}/v1/chat/completions",
                  json.dumps({"messages": _first()}).encode())
        assert r.status_code == 504 and r.json()["error"]["code"] == "generation_timeout"
        assert s.trajectories == [] and s.status == "open"
    finally:
        server.close()


def test_concurrent_calls_of_one_session_run_one_at_a_time(renderer):
    server, gateway, calls = gf.scripted(renderer, ["a", "b", "c", "d"])
    try:
        session = gateway.store.open()
        errors = []

        def call():
            try:
                gf.client(server, session.id).chat.completions.create(
                    model="m", messages=_first())
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        # the same history four times: one trajectory, then three regenerations (branches
        # from the root, since no sampled turn is in the history)
        assert gateway.store.counts["calls"] == 4 and len(session.trajectories) == 4
        assert gateway.store.counts["branches_from_root"] == 3
    finally:
        server.close()


def test_completions_reuse_token_prefixes_and_n_choices_fork(renderer):
    server, gateway, calls = gf.scripted(renderer, ["a", "b", "c", "d"])
    try:
        session = gateway.store.open()
        client = gf.client(server, session.id)
        prompt = renderer.encode("What is 12 times 7?")
        r = client.completions.create(model="m", prompt=prompt, logprobs=1)
        first = r.choices[0].model_extra["rlflow"]["token_ids"]
        assert r.choices[0].logprobs.token_logprobs == [-1.0] * len(first)
        # a prompt that extends the recorded ids extends the trajectory (no branch)
        more = prompt + first + renderer.encode(" again")
        client.completions.create(model="m", prompt=more)
        c = gateway.store.counts
        assert c["branches"] == 0 and c["reused_tokens"] == len(prompt) + len(first)
        assert calls.prompts[1] == more
        ep = session.episode()
        second = renderer.encode("b") + [renderer.turn_end_id]
        assert ep["prompt"].tolist() == prompt
        assert ep["tokens"].tolist() == first + renderer.encode(" again") + second
        assert ep["tokens"][ep["mask"]].tolist() == first + second
        # n = 2 chat choices: one extends, the other is a fork the next history may pick
        s2 = gateway.store.open()
        r = gf.client(server, s2.id).chat.completions.create(model="m", messages=_first(), n=2)
        assert len(r.choices) == 2 and c["forks"] == 1 and len(s2.trajectories) == 2
    finally:
        server.close()


def test_closed_external_sessions_are_kept_bounded(renderer, monkeypatch):
    from rlflow.gateway import sessions

    monkeypatch.setattr(sessions, "KEEP_CLOSED_EXTERNAL", 2)
    server, gateway, _ = gf.scripted(renderer, [])
    try:
        opened = [gateway.store.open() for _ in range(4)]
        for s in opened:
            gateway.end(s, reward=1.0)
        ids = [s.id for s in opened]
        with pytest.raises(sessions.GatewayError, match="unknown session"):
            gateway.store.get(ids[0])
        with pytest.raises(sessions.GatewayError, match="is ended"):
            gateway.store.get(ids[3])
    finally:
        server.close()
