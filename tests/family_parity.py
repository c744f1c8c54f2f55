"""Shared pieces of the 2026 families' transformers parity tests (tests/unit/models/
test_hf_families.py, test_qwen35.py): the token rows, rlflow's jitted forward, transformers'
float32 logits of a folder, the two-program bound and the left-padded batch of the rows."""

from __future__ import annotations

import functools

import numpy as np
import torch
from flax import nnx

import jax
import jax.numpy as jnp
from rlflow.models import positions_from_mask
from tolerances import forward_atol

# three rows of different lengths; the longest is over twice the families' sliding window
SEQS = [np.array(s, np.int32) for s in
        ([17, 200, 31, 4, 99, 250, 8, 64, 128, 7, 11], [5, 77, 190, 3, 42, 9, 13], [211, 9])]
forward = nnx.jit(lambda m, t, p, mask: m(t, p, mask))


@functools.cache
def hf_model(path: str, attn_implementation: str | None = None):
    """transformers' float32 model of the folder ``path`` (eval mode, cached per path)."""
    from transformers import AutoModelForCausalLM
    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def hf_logits(path: str, seq: np.ndarray, attn_implementation: str | None = None) -> np.ndarray:
    """transformers' logits ``[len(seq), vocab]`` float32 of the one row ``seq``."""
    with torch.no_grad():
        model = hf_model(path, attn_implementation)
        return model(input_ids=torch.tensor(seq[None]).long()).logits[0].numpy()


def atol(cfg, seq, ref) -> float:
    """The bound on two float32 programs' logits (tests/tolerances.py) at ``ref``'s scale."""
    return forward_atol(cfg, seq, float(np.abs(ref).max()))


def left_padded_logits(model) -> tuple[np.ndarray, int]:
    """rlflow's logits ``[len(SEQS), w, vocab]`` of :data:`SEQS` left-padded to the longest
    row's length ``w``, and ``w`` (row b's tokens sit at ``[w - len(SEQS[b]):]``)."""
    w = max(map(len, SEQS))
    toks, mask = np.zeros((len(SEQS), w), np.int32), np.zeros((len(SEQS), w), bool)
    for b, s in enumerate(SEQS):
        toks[b, w - len(s):], mask[b, w - len(s):] = s, True
    return np.asarray(forward(model, jnp.asarray(toks), positions_from_mask(mask),
                              jnp.asarray(mask))), w



def assert_packed_row_equals_each_sequence(model, cfg, path: str, **hf_kwargs) -> None:
    """:data:`SEQS` packed in one row (segment ids, positions restarting at 0): each
    segment's rlflow logits are transformers' of the sequence alone (:func:`hf_logits` of
    ``path``, ``hf_kwargs`` passed on), within :func:`atol` at the row's length."""
    toks = np.concatenate(SEQS)[None]
    seg = np.concatenate([np.full(len(s), i) for i, s in enumerate(SEQS)])[None]
    pos = np.concatenate([np.arange(len(s)) for s in SEQS])[None]
    fwd = nnx.jit(lambda m, t, p, a, s: m(t, p, a, segment_ids=s))
    ours = np.asarray(fwd(model, jnp.asarray(toks), jnp.asarray(pos, jnp.int32),
                          jnp.ones(toks.shape, bool), jnp.asarray(seg, jnp.int32)))[0]
    start = 0
    for s in SEQS:
        ref = hf_logits(path, s, **hf_kwargs)
        np.testing.assert_allclose(ours[start:start + len(s)], ref, rtol=0,
                                   atol=atol(cfg, toks.shape[1], ref))
        start += len(s)

def recompute_logprobs(model, prompt, tokens) -> np.ndarray:
    """The learner's recompute: float32 logprobs (temperature 1) of ``tokens`` after
    ``prompt`` by one full forward over prompt + completion."""
    from rlflow.models.logprobs import token_logprobs
    seq = np.asarray(list(prompt) + list(tokens), np.int32)[None]
    mask = jnp.ones(seq.shape, bool)
    logits = forward(model, jnp.asarray(seq), positions_from_mask(mask), mask)
    lp = np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(seq[:, 1:]), 1.0))[0]
    return lp[len(prompt) - 1:]


def family_engine(model, num_pages: int = 0, kv_cache: str = "paged"):
    """The families' engine, contiguous or paged: 4 slots, buckets (8, 16), 10 new tokens,
    2 decode steps per call; paged: pages of 4 tokens, ``num_pages`` of them (7: one
    full-length sequence, so four running samples preempt each other)."""
    from rlflow.config import MeshConfig, SamplerConfig
    from rlflow.mesh import make_mesh
    from rlflow.sampler.engine import RlflowEngine
    return RlflowEngine(model, SamplerConfig(
        num_slots=4, max_prefill_length=16, prefill_buckets=(8, 16), max_tokens=10,
        temperature=0.0, kv_cache=kv_cache, page_size=4, num_pages=num_pages,
        decode_steps_per_call=2), mesh=make_mesh(MeshConfig(), jax.devices()[:1]))


def greedy_text_and_logprobs(engine, model, cfg, hf) -> "object":
    """Greedy and sampled requests of :data:`SEQS` decoded together by ``engine``: the
    greedy text is ``hf``'s ``generate``; the sampled completions' behaviour logprobs
    (temperature 1) equal the learner's recompute. Then a decode call over the slots, all
    inactive now, leaves every gated DeltaNet state and sliding-window ring as it was (an
    inactive slot's token writes nothing a later token reads: a parked episode's state).
    Returns the batcher's counters."""
    from rlflow.sampler.batching import ContinuousBatcher, Request
    from rlflow.sampler.sampling import SamplingParams

    prompts = [s.tolist() for s in SEQS]
    greedy = [Request(i, p, 1, SamplingParams(temperature=0.0, max_tokens=10))
              for i, p in enumerate(prompts)]
    sampled = [Request(10 + i, p, 2, SamplingParams(temperature=1.0, max_tokens=8, seed=5 + i))
               for i, p in enumerate(prompts[:2])]
    batcher = ContinuousBatcher(engine)
    groups = {g.prompt_id: g for g in batcher.run(greedy + sampled)}
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                              dtype=torch.long), do_sample=False, max_new_tokens=10)
        ours = groups[i].completions[0].tokens.tolist()
        assert len(ours) > 0
        assert ours == ref[0, len(p):len(p) + len(ours)].tolist(), (cfg.model_type, i)
    for i, p in enumerate(prompts[:2]):
        for c in groups[10 + i].completions:
            ref = recompute_logprobs(model, p, c.tokens.tolist())
            np.testing.assert_allclose(c.logprobs, ref, rtol=0,
                                       atol=atol(cfg, len(p) + len(ref), ref))
    cache = batcher._state.cache
    kept = [i for i, kind in enumerate(cfg.kinds) if kind == "sliding_attention"]
    held = lambda c: [np.asarray(a) for a in jax.tree_util.tree_leaves(  # noqa: E731
        (c.linear, [c.k[i] for i in kept], [c.v[i] for i in kept]))]
    before = held(cache)
    assert before and not np.asarray(batcher._state.active).any()
    state, _ = engine.generate_packed(batcher._params, batcher._state)
    for a, b in zip(before, held(state.cache)):
        np.testing.assert_array_equal(a, b)
    return batcher.counters


def swap_in_flight(engine, model, cfg, prompt) -> "object":
    """A weight swap after 2 decode calls (of 2 steps): the new weights differ in the final
    norm only (so the keys, values and DeltaNet states written under either version are
    the same), and every sampled token's logprob is the recompute under the version that
    sampled it; each of the 2 samples spans the swap. Returns the batcher's counters."""
    from rlflow.sampler.batching import ContinuousBatcher, Request
    from rlflow.sampler.sampling import SamplingParams

    graphdef, w0 = nnx.split(model, nnx.Param)
    w1 = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 1.5 + 0.1 if "final_norm" in jax.tree_util.keystr(path) else x, w0)
    batcher = ContinuousBatcher(engine, params=w0, version=0)
    batcher.submit(Request(0, prompt, 2, SamplingParams(temperature=1.0, max_tokens=10,
                                                        seed=9, stop_token_ids=())))
    batcher.step()
    batcher.step()
    batcher.update_params(w1, version=1)
    groups = []
    while batcher.has_work:
        groups += batcher.step()
    spans = 0
    for c in groups[0].completions:
        spans += int((c.versions == 0).any() and (c.versions == 1).any())
        for v, w in ((0, w0), (1, w1)):
            lp = recompute_logprobs(nnx.merge(graphdef, w), prompt, c.tokens.tolist())
            at = np.asarray(c.versions) == v
            np.testing.assert_allclose(np.asarray(c.logprobs)[at], lp[at], rtol=0,
                                       atol=atol(cfg, len(prompt) + len(lp), lp))
    assert spans == 2, [c.versions for c in groups[0].completions]
    return batcher.counters
