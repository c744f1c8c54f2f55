"""Issue 52 acceptance 1: the official ``openai`` client drives the gateway (chat completions
with tools, streaming, logprobs) on a tiny random model behind a real continuous batcher; the
session's recorded episode holds exactly the ids the sampler generated, its behaviour
logprobs equal the learner's recompute of the episode (float32), and the tool results (and
every other token the policy did not sample) have no loss."""

import jax.numpy as jnp
import numpy as np
import pytest

from rlflow.gateway.calls import CallQueue
from rlflow.models.logprobs import token_logprobs
from tolerances import forward_atol

import gateway_fixtures as gf

pytest.importorskip("openai")


class RecordingCalls(CallQueue):
    """The batcher's completions of every call, as the sampler generated them."""

    def __init__(self):
        super().__init__()
        self.generated = []

    def generate(self, prompt_ids, n, sampling, timeout_s):
        out = super().generate(prompt_ids, n, sampling, timeout_s)
        self.generated.append((list(prompt_ids), sorted(out, key=lambda c: c.sample_index)))
        return out


@pytest.fixture(scope="module")
def stack():
    return gf.tiny_stack(max_prefill=1024)


def test_openai_client_session_records_sampled_ids_and_learner_logprobs(stack):
    tok, renderer, model, engine, state, forward = stack
    from rlflow.gateway.calls import BatcherThread
    from rlflow.gateway.server import GatewayServer
    from rlflow.gateway.service import Gateway
    from rlflow.gateway.sessions import SessionStore
    from rlflow.sampler.batching import ContinuousBatcher
    from rlflow.sampler.sampling import SamplingParams

    cfg = engine.sampler_cfg
    store = SessionStore(renderer, max_prompt_tokens=cfg.max_prefill_length,
                         max_episode_tokens=256, max_call_tokens=cfg.max_tokens)
    calls = RecordingCalls()
    thread = BatcherThread(ContinuousBatcher(engine, params=state, version=3), calls)
    gateway = Gateway(store, calls, SamplingParams.from_config(cfg, seed=0))
    server = GatewayServer(gateway, gf.KEY)
    try:
        session = store.open()
        client = gf.client(server, session.id)
        messages = [{"role": "system", "content": gf.SYSTEM},
                    {"role": "user", "content": "What is 12 times 7?"}]
        texts, tool_texts = [], []
        for call in range(4):
            kw = dict(model="tiny", messages=messages, tools=gf.TOOLS, logprobs=True,
                      seed=100 + call)
            if call == 2:                                   # streamed, with usage
                stream = client.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kw)
                chunks = list(stream)
                content = "".join(c.choices[0].delta.content or "" for c in chunks
                                  if c.choices)
                lps = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
                       for e in c.choices[0].logprobs.content]
                finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
                assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens \
                    == len(calls.generated[-1][1][0].tokens)
                message = {"role": "assistant", "content": content}
            else:
                r = client.chat.completions.create(**kw)
                choice = r.choices[0]
                content, finish = choice.message.content, choice.finish_reason
                lps = [e.logprob for e in choice.logprobs.content]
                message = choice.message.model_dump(exclude_none=True)
            generated = calls.generated[-1][1][0]
            # the response's logprobs are the sampler's behaviour logprobs, token by token
            np.testing.assert_array_equal(np.float32(lps), generated.logprobs)
            assert content == renderer.assistant_text(generated.tokens)
            assert finish == ("stop" if generated.finish_reason == "stop" else "length")
            texts.append(content)
            messages.append(message)
            tool = f"result {call}: 84"
            tool_texts.append(tool)
            messages.append({"role": "tool", "tool_call_id": f"call_{call}", "content": tool})

        episode = session.episode()
        sampled = [c.tokens for _, (c,) in calls.generated]
        mask = episode["mask"]
        tokens = episode["tokens"]
        # the sampled ids, in order, are exactly the masked ids; each turn once
        np.testing.assert_array_equal(tokens[mask], np.concatenate(sampled))
        np.testing.assert_array_equal(episode["logprobs"][mask],
                                      np.concatenate([c.logprobs for _, (c,) in calls.generated]))
        assert (episode["versions"][mask] == 3).all() and (episode["versions"][~mask] == -1).all()
        assert (episode["logprobs"][~mask] == 0).all()
        # each call's prompt is the episode so far (recorded ids reused, nothing re-tokenized)
        full = np.concatenate([episode["prompt"], tokens]).tolist()
        ended = [c.tokens[-1] == renderer.turn_end_id for _, (c,) in calls.generated]
        assert all(ended[:3]), "fixed seeds: every continued turn ends on <|im_end|>"
        for prompt, _ in calls.generated:
            assert full[:len(prompt)] == prompt
        assert gateway.store.counts["branches"] == 0
        # call k reuses all of call k-1's prompt and sampled ids
        assert gateway.store.counts["reused_tokens"] == sum(
            len(p) + len(c.tokens) for p, (c,) in calls.generated[:3])
        # tool results are in the episode and have no loss
        unmasked = tok.decode(tokens[~mask].tolist())
        for text in tool_texts[:3]:
            assert f"<tool_response>\n{text}\n</tool_response>" in unmasked
        # the learner's recompute (float32) of every sampled token's logprob
        seq = jnp.asarray([full], jnp.int32)
        logits = forward(state, seq, jnp.arange(seq.shape[1])[None], jnp.ones(seq.shape, bool))
        p = len(episode["prompt"])
        lp = np.asarray(token_logprobs(logits[0, p - 1:-1].astype(jnp.float32),
                                       jnp.asarray(tokens)))
        atol = forward_atol(model.cfg, len(full), float(np.abs(lp).max()))
        np.testing.assert_allclose(episode["logprobs"][mask], lp[mask], rtol=0, atol=atol)
    finally:
        server.close()
        thread.close()
