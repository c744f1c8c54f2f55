"""A gateway on a tiny random model (the ChatML/Qwen2.5 tokenizer of ``chat_fixtures``) behind
a real continuous batcher, for the gateway tests; and a scripted backend for the tool-call
round trip (a random model never writes a tool call)."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from flax import nnx

from chat_fixtures import tiny_tokenizer

KEY = "test-gateway-key-0123"
SYSTEM = "You are a helpful assistant."
TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "run python",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}]


def tiny_stack(num_slots: int = 4, max_prefill: int = 512, max_tokens: int = 12,
               lead: float = 4.0):
    """``(tokenizer, renderer, model, engine, state, forward)``: a sharpened random model
    (weights x 4) whose output head's column of ``<|im_end|>`` is set so that its logit
    leads by about ``lead`` where the hidden states' common direction is strong (least
    squares on a rendered conversation's logits), so that turns end within a few tokens
    (the KV cache is unaffected by the head)."""
    from rlflow.config import MeshConfig, ModelConfig, SamplerConfig
    from rlflow.envs.chat import ChatRenderer
    from rlflow.mesh import make_mesh
    from rlflow.models import build_model
    from rlflow.sampler.engine import RlflowEngine
    from sampler_fixtures import logits_of

    tok = tiny_tokenizer("chatml")
    renderer = ChatRenderer(tok)
    model = build_model(ModelConfig(vocab_size=len(tok), tie_word_embeddings=False,
                                    init_seed=3))[0]
    nnx.update(model, jax.tree_util.tree_map(lambda x: x * 4.0, nnx.state(model, nnx.Param)))
    graphdef, state = nnx.split(model, nnx.Param)
    forward = jax.jit(lambda st, t, p, m: nnx.merge(graphdef, st)(t, p, m))
    prompt = renderer.prompt_ids([{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "What is 12 times 7?"}])
    ids = prompt + renderer.encode("The answer is 84. #### 84 python tool")
    state = with_end_of_turn_led(state, np.asarray(logits_of(forward, state, ids)),
                                 renderer.turn_end_id, lead)
    nnx.update(model, state)
    cfg = SamplerConfig(num_slots=num_slots, max_prefill_length=max_prefill,
                        prefill_buckets=(128, 256, max_prefill), max_tokens=max_tokens,
                        temperature=1.0, decode_steps_per_call=1)
    engine = RlflowEngine(model, cfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]),
                          eos_token_ids=renderer.end_of_turn_ids)
    return tok, renderer, model, engine, state, forward


def with_end_of_turn_led(state, logits, eot: int, lead: float):
    """Params whose output column of ``eot`` is ``u (max logit + lead) / |u|^2`` with ``u``
    the mean hidden state behind ``logits`` ``[S, V]`` (``H = L W^+``)."""
    import jax.numpy as jnp

    pure = jax.tree_util.tree_map(lambda x: x, state.to_pure_dict())
    head = np.array(pure["lm_head"], np.float64)                 # [H, V]
    hidden = np.linalg.lstsq(head.T, np.asarray(logits, np.float64).T, rcond=None)[0].T
    u = hidden.mean(axis=0)
    target = float(np.mean(np.max(logits, axis=-1))) + lead
    head[:, eot] = u * target / float(u @ u)
    pure["lm_head"] = jnp.asarray(head, pure["lm_head"].dtype)
    new = jax.tree_util.tree_map(lambda x: x, state)
    nnx.replace_by_pure_dict(new, pure)
    return new


@contextlib.contextmanager
def served(renderer, engine, state, *, max_episode_tokens: int = 256,
           call_timeout_s: float = 120.0, on_end=None):
    """A running gateway over a :class:`BatcherThread`: yields ``(server, gateway)``."""
    from rlflow.gateway.calls import BatcherThread, CallQueue
    from rlflow.gateway.server import GatewayServer
    from rlflow.gateway.service import Gateway
    from rlflow.gateway.sessions import SessionStore
    from rlflow.sampler.batching import ContinuousBatcher
    from rlflow.sampler.sampling import SamplingParams

    cfg = engine.sampler_cfg
    store = SessionStore(renderer, max_prompt_tokens=cfg.max_prefill_length,
                         max_episode_tokens=max_episode_tokens, max_call_tokens=cfg.max_tokens)
    calls = CallQueue()
    batcher = ContinuousBatcher(engine, params=state, version=0)
    thread = BatcherThread(batcher, calls)
    gateway = Gateway(store, calls, SamplingParams.from_config(cfg, seed=0),
                      call_timeout_s=call_timeout_s, on_end=on_end)
    server = GatewayServer(gateway, KEY)
    try:
        yield server, gateway
    finally:
        server.close()
        thread.close()


class ScriptedCalls:
    """A backend that answers each call with the next scripted text (+ ``<|im_end|>``),
    logprob -1.0 per token, policy version 7."""

    def __init__(self, renderer, texts):
        self.renderer, self.texts = renderer, list(texts)
        self.prompts = []

    def generate(self, prompt_ids, n, sampling, timeout_s):
        from rlflow.sampler.requests import Completion

        self.prompts.append(list(prompt_ids))
        ids = self.renderer.encode(self.texts.pop(0)) + [self.renderer.turn_end_id]
        return [Completion(0, i, np.asarray(ids, np.int32), np.full(len(ids), -1.0, np.float32),
                           np.full(len(ids), 7, np.int32), "stop") for i in range(n)]


def scripted(renderer, texts, *, max_episode_tokens: int = 512):
    """``(server, gateway, calls)`` over :class:`ScriptedCalls` (close ``server``)."""
    from rlflow.gateway.server import GatewayServer
    from rlflow.gateway.service import Gateway
    from rlflow.gateway.sessions import SessionStore
    from rlflow.sampler.sampling import SamplingParams

    store = SessionStore(renderer, max_prompt_tokens=1024,
                         max_episode_tokens=max_episode_tokens, max_call_tokens=64)
    calls = ScriptedCalls(renderer, texts)
    gateway = Gateway(store, calls, SamplingParams(temperature=1.0, max_tokens=64))
    return GatewayServer(gateway, KEY), gateway, calls


def client(server, session: str, **kw):
    """An official ``openai.OpenAI`` client on a session's base URL."""
    import openai

    return openai.OpenAI(base_url=server.session_url(session), api_key=KEY, max_retries=0,
                         **kw)
