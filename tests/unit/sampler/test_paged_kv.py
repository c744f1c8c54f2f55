"""Paged KV cache (issue 43 item 5): the host page allocator, page writes / gathers against a
numpy oracle, the decoder's cached forward over pages equal to the contiguous cache, and the
batcher with ``sampler.kv_cache = "paged"``: same completions as the contiguous cache, a
group's prompt pages shared, and a pool too small for every sequence in flight finishing
every prompt by preemption and resume (nothing lost, nothing sampled twice)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlflow.config import ConfigError, MeshConfig, SamplerConfig
from rlflow.mesh import make_mesh
from rlflow.models.kv_cache import init_cache
from rlflow.models.paged_kv_cache import (gather_pages, init_paged_cache, page_slots,
                                          resolve_attention, write_pages)
from rlflow.sampler.batching import ContinuousBatcher, Request
from rlflow.sampler.engine import RlflowEngine
from rlflow.sampler.page_pool import PagePool, pages_for
from rlflow.sampler.sampling import SamplingParams
from test_engine import one_device_mesh, random_model
from tolerances import forward_atol


def _logits_cache(out):
    """``(logits, new cache)`` of a ``forward_cached`` result."""
    return out.logits, out.cache


# ---------------------------------------------------------------------- allocator

def test_page_pool_takes_shares_and_frees_pages():
    pool = PagePool(num_pages=6, page_size=4, slots=3, pages_per_slot=4)
    assert pages_for(0, 4) == 0 and pages_for(1, 4) == 1 and pages_for(8, 4) == 2
    assert pool.assign(0, [], 2) and pool.table[0].tolist() == [0, 1, 6, 6]
    shared = pool.table[0, :1].tolist()
    assert pool.assign(1, shared, 1)                        # page 0 shared, one own page
    assert pool.table[1].tolist() == [0, 2, 6, 6] and pool.refs(0) == 2
    assert pool.num_free == 3
    assert pool.grow(1, 9) and pool.table[1].tolist() == [0, 2, 3, 6]    # 9 tokens: 3 pages
    assert pool.grow(1, 40) and pool.table[1].tolist() == [0, 2, 3, 4]   # capped at 4
    v = pool.version
    assert not pool.assign(2, [], 2) and pool.version == v and pool.held(2) == 0  # 1 free
    pool.free_slot(0)
    assert pool.refs(0) == 1 and pool.refs(1) == 0 and pool.num_free == 2
    assert pool.table[0].tolist() == [6] * 4
    pool.free_slot(1)
    assert pool.num_free == 6 and (pool.table == 6).all()


def test_page_pool_refuses_bad_use():
    pool = PagePool(num_pages=3, page_size=2, slots=2, pages_per_slot=2)
    with pytest.raises(MemoryError, match="4 pages asked, 3 free"):
        pool.take(4)
    with pytest.raises(ValueError, match="page 1 is already free"):
        pool.release([1])
    with pytest.raises(ValueError, match="free page"):
        pool.share([2])
    with pytest.raises(ValueError, match="pass the 2 pages of a slot"):
        pool.assign(0, [], 3)
    assert pool.assign(0, [], 1)
    with pytest.raises(ValueError, match="slot 0 holds 1 pages"):
        pool.assign(0, [], 1)
    with pytest.raises(ValueError, match="must be > 0"):
        PagePool(0, 2, 1, 1)


def test_config_bounds_the_pool():
    cfg = SamplerConfig(num_slots=4, max_prefill_length=16, prefill_buckets=(16,),
                        max_tokens=8, kv_cache="paged", page_size=5)
    assert cfg.pages_per_slot == 5 and cfg.pool_pages == 20
    with pytest.raises(ConfigError, match=r"sampler.num_pages: .* at least the 5 pages"):
        dataclasses.replace(cfg, num_pages=4)
    with pytest.raises(ConfigError, match="sampler.kv_cache"):
        dataclasses.replace(cfg, kv_cache="blocks")
    assert resolve_attention("auto", "cpu") == "gather"
    assert resolve_attention("auto", "tpu") == "kernel"
    with pytest.raises(ValueError, match="needs a TPU"):
        resolve_attention("kernel", "gpu")


# ---------------------------------------------------------------------- device pages
def test_write_and_gather_pages_against_numpy():
    rng = np.random.default_rng(0)
    k, n, p, d, b, m = 2, 7, 3, 4, 2, 3
    pool = rng.normal(size=(k, n, p, d)).astype(np.float32)
    table = np.array([[5, 0, n], [2, 6, 1]], np.int32)           # row 0: 2 pages
    cols = np.array([[0, 4, 6], [2, 3, 8]], np.int32)            # row 0 col 6: no page
    new = rng.normal(size=(b, 3, k, d)).astype(np.float32)
    page, off = page_slots(jnp.asarray(table), jnp.asarray(cols), p)
    got = np.asarray(write_pages(jnp.asarray(pool), jnp.asarray(new), page, off))
    want = pool.copy()
    for r in range(b):
        for t in range(3):
            j = cols[r, t] // p
            if j < m and table[r, j] < n:
                want[:, table[r, j], cols[r, t] % p] = new[r, t]
    np.testing.assert_array_equal(got, want)
    rows = np.asarray(gather_pages(jnp.asarray(got), jnp.asarray(table)))    # [B, K, M*P, D]
    for r in range(b):
        for pos in range(m * p):
            phys = min(table[r, pos // p], n - 1)                # "no page" clamps
            np.testing.assert_array_equal(rows[r, :, pos], got[:, phys, pos % p])


def test_cached_forward_over_pages_equals_the_contiguous_cache():
    """Prefill 5 tokens then 3 decode steps per row, pages scattered over the pool: logits
    within two float32 programs' bound of the contiguous cache's (tests/tolerances.py)."""
    model = random_model(scale=3.0, init_seed=2)
    cfg, b, s, p = model.cfg, 2, 12, 4
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 8)), jnp.int32)
    contiguous = init_cache(cfg, b, s)
    paged = init_paged_cache(cfg, b, num_pages=9, page_size=p, pages_per_row=3)
    paged = paged.replace(page_table=jnp.asarray([[7, 2, 4], [0, 8, 5]], jnp.int32))
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda st, *a: _logits_cache(nnx.merge(graphdef, st).forward_cached(*a)))
    outs = {}
    for name, cache in (("contiguous", contiguous), ("paged", paged)):
        mask = jnp.arange(5)[None] < jnp.asarray([[5], [3]])      # row 1: 3 real tokens
        logits, cache = forward(state, tokens[:, :5], jnp.broadcast_to(jnp.arange(5), (b, 5)),
                                mask, cache, jnp.zeros((b,), jnp.int32))
        steps = [logits]
        index = jnp.asarray([5, 3], jnp.int32)
        for t in range(3):
            logits, cache = forward(state, tokens[:, 5 + t:6 + t], index[:, None],
                                    jnp.ones((b, 1), bool), cache, index)
            steps.append(logits)
            index = index + 1
        outs[name] = [np.asarray(x) for x in steps]
    for a, c in zip(outs["contiguous"], outs["paged"]):
        np.testing.assert_allclose(c, a, rtol=0, atol=forward_atol(
            cfg, s, float(np.abs(a).max())))


# ---------------------------------------------------------------------- the batcher
PROMPTS = [[1 + i, 5, 6 + i][: 1 + i % 3] + [9] * (i % 5) + [3] * (i % 7) for i in range(8)]


def requests():
    """5 prompts (1..12 tokens) x 3 samples at temperature 1, lengths 16 - 2i (no stop ids,
    so every completion's length is known); and 2 greedy ones."""
    reqs = [Request(100 + i, PROMPTS[i], 3, SamplingParams(
        temperature=1.0, max_tokens=16 - 2 * i, seed=i, stop_token_ids=())) for i in range(5)]
    return reqs + [Request(200 + i, PROMPTS[i], 1, SamplingParams(
        temperature=0.0, max_tokens=16, stop_token_ids=())) for i in (3, 6)]


@pytest.fixture(scope="module")
def model():
    return random_model(scale=6.0, init_seed=1, tie_word_embeddings=False)


BASE = SamplerConfig(num_slots=4, max_prefill_length=16, prefill_buckets=(16,),
                     max_tokens=16, temperature=1.0, decode_steps_per_call=3,
                     max_prefill_batch=2)         # (one bucket, two batch sizes: few compiles)


def run(model, cfg, reqs=None, mesh=None):
    engine = RlflowEngine(model, cfg, mesh=mesh or one_device_mesh())
    batcher = ContinuousBatcher(engine)
    groups = batcher.run(requests() if reqs is None else reqs)
    return {g.prompt_id: g for g in groups}, batcher


@pytest.fixture(scope="module")
def contiguous(model):
    return run(model, BASE)[0]


def assert_same_completions(model, got, ref):
    """Same prompts, every sample once, same tokens and versions; behaviour logprobs within
    two float32 programs' bound (tests/tolerances.py, the longest sequence)."""
    assert got.keys() == ref.keys()
    for pid, g in got.items():
        assert [c.sample_index for c in g.completions] == list(range(len(g.completions)))
        for c, r in zip(g.completions, ref[pid].completions):
            assert c.tokens.tolist() == r.tokens.tolist(), (pid, c.sample_index)
            assert c.versions.tolist() == r.versions.tolist()
            assert c.finish_reason == r.finish_reason
            np.testing.assert_allclose(c.logprobs, r.logprobs, rtol=0, atol=forward_atol(
                model.cfg, 32, float(np.abs(r.logprobs).max())))


def test_paged_batcher_equals_contiguous(model, contiguous):
    """A pool as large as the contiguous cache: no waits, no preemption, same completions
    (pages of 4 and of 5 tokens: a page size that does not divide the cache length)."""
    for page in (4, 5):
        got, batcher = run(model, dataclasses.replace(BASE, kv_cache="paged", page_size=page))
        assert batcher.counters.preemptions == 0 and batcher.counters.page_waits == 0
        assert_same_completions(model, got, contiguous)
        assert batcher._pool.num_free == batcher._pool.num_pages      # every page returned


def test_a_pool_too_small_finishes_every_prompt(model, contiguous):
    """6 slots over a pool of 8 pages of 4 tokens, the least the config allows (one
    full-length sequence is 8 pages): sequences wait for pages and are preempted and resumed
    many times, and every group comes back whole with the contiguous cache's completions."""
    cfg = dataclasses.replace(BASE, kv_cache="paged", page_size=4, num_pages=8, num_slots=6)
    got, batcher = run(model, cfg)
    c = batcher.counters
    assert c.preemptions > 0 and c.page_waits > 0
    assert c.completions_truncated == sum(r.num_samples for r in requests())
    assert_same_completions(model, got, contiguous)
    assert batcher._pool.num_free == 8 and not batcher.has_work


def test_group_samples_share_their_prompt_pages(model):
    """A 12-token prompt (11 cached positions) in pages of 4: its 3 samples' tables share
    the 2 full prompt pages (referenced 3 times once the group is admitted) and each has
    its own page for the prompt's end and its completion."""
    cfg = dataclasses.replace(BASE, kv_cache="paged", page_size=4, decode_steps_per_call=1)
    engine = RlflowEngine(model, cfg, mesh=one_device_mesh())
    batcher = ContinuousBatcher(engine)
    batcher.submit(Request(1, list(range(1, 13)), 3, SamplingParams(
        temperature=1.0, max_tokens=8, seed=0, stop_token_ids=())))
    batcher.step()
    pool = batcher._pool
    rows = pool.table[:3]
    assert (rows[:, :2] == rows[0, :2]).all()
    assert len({int(r) for r in rows[:, 2]}) == 3
    assert [pool.refs(int(x)) for x in rows[0, :2]] == [3, 3]
    assert pool.num_free == pool.num_pages - 2 - 3


@pytest.mark.slow
def test_sharded_paged_engine_matches_single_device(model, contiguous):
    """data 2 x tensor 2 (fake CPU devices): pools split over KV heads, page tables over
    slots; the same completions as the one-device contiguous cache."""
    cfg = dataclasses.replace(BASE, kv_cache="paged", page_size=4, num_pages=12, num_slots=4,
                              num_devices=4, mesh=MeshConfig(data=2, tensor=2))
    got, batcher = run(model, cfg, mesh=make_mesh(cfg.mesh, jax.devices()))
    assert batcher.counters.preemptions > 0
    assert_same_completions(model, got, contiguous)


def _reference_paged_attention(q, k_pages, v_pages, lengths, page_indices, *,
                               pages_per_compute_block, **_):
    """:func:`_numpy_paged_attention` as a host callback (so the forward can be jitted)."""
    assert page_indices.shape[1] % pages_per_compute_block == 0
    return jax.pure_callback(_numpy_paged_attention, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                             q, k_pages, v_pages, lengths, page_indices)


def _numpy_paged_attention(q, k_pages, v_pages, lengths, page_indices):
    """The documented math of ``jax.experimental.pallas.ops.tpu.paged_attention`` (a TPU
    kernel) in numpy: per row ``b`` and query head ``h`` (KV head ``h // (H / K)``),
    ``softmax(q . k) v`` over the row's first ``lengths[b]`` positions, position ``t`` in
    page ``page_indices[b, t // P]`` at offset ``t % P`` (no scaling of ``q``)."""
    q, kp, vp = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    b, h, d = q.shape
    kh, _, p, _ = kp.shape
    out = np.zeros((b, h, d))
    for r in range(b):
        t = np.arange(int(lengths[r]))
        pages = np.asarray(page_indices)[r, t // p]
        for j in range(h):
            keys, values = kp[j // (h // kh), pages, t % p], vp[j // (h // kh), pages, t % p]
            s = keys @ q[r, j]
            w = np.exp(s - s.max())
            out[r, j] = (w / w.sum()) @ values
    return out.astype(np.float32)


def test_kernel_attention_plumbing_against_the_kernels_math(monkeypatch):
    """``paged_attention="kernel"`` hands the TPU kernel q scaled by 1/sqrt(D), the pools in
    its layout, lengths ``index + 1`` and the page table: with the kernel replaced by a numpy
    version of its documented math (no TPU here), decode logits equal the gather path's
    within two float32 programs' bound."""
    import jax.experimental.pallas.ops.tpu.paged_attention as kernel_module
    monkeypatch.setattr(kernel_module, "paged_attention", _reference_paged_attention)
    model = random_model(scale=3.0, init_seed=4)
    cfg, b, p = model.cfg, 2, 4
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (b, 7)), jnp.int32)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda st, *a: _logits_cache(nnx.merge(graphdef, st).forward_cached(*a)))
    out = {}
    for attention in ("gather", "kernel"):
        cache = init_paged_cache(cfg, b, num_pages=6, page_size=p, pages_per_row=2,
                                 attention=attention)
        cache = cache.replace(page_table=jnp.asarray([[4, 1], [0, 5]], jnp.int32))
        _, cache = forward(state, tokens[:, :5], jnp.broadcast_to(jnp.arange(5), (b, 5)),
                           jnp.ones((b, 5), bool), cache, jnp.zeros((b,), jnp.int32))
        steps = []
        for t in range(2):
            index = jnp.full((b,), 5 + t, jnp.int32)
            logits, cache = forward(state, tokens[:, 5 + t:6 + t], index[:, None],
                                    jnp.ones((b, 1), bool), cache, index)
            steps.append(np.asarray(logits))
        out[attention] = steps
    for g, k in zip(out["gather"], out["kernel"]):
        np.testing.assert_allclose(k, g, rtol=0, atol=forward_atol(cfg, 8, float(np.abs(g).max())))


def test_a_weight_swap_between_a_groups_samples_takes_fresh_prompt_pages(model):
    """2 slots, a group of 3: sample 0 stops on its first token while sample 1 decodes on,
    then a swap to weights that change the KV entries; sample 2, admitted after it, has its
    prompt prefilled again into fresh pages (writing them into the pages sample 1 still
    reads would change its completion): every completion is the contiguous cache's under
    the same schedule."""
    w1 = jax.tree_util.tree_map(lambda x: x * 0.9, nnx.state(model, nnx.Param))
    prompt = list(range(1, 12))
    cfg = dataclasses.replace(BASE, num_slots=2, decode_steps_per_call=1, page_size=4)
    sampling = SamplingParams(temperature=1.0, max_tokens=6, seed=5, stop_token_ids=())
    first = run(model, cfg, [Request(1, prompt, 2, sampling)])[0][1].completions
    stop = int(first[0].tokens[0])
    assert stop not in first[1].tokens.tolist()       # so sample 1 runs on (seed chosen so)
    out = {}
    for kv_cache in ("contiguous", "paged"):
        engine = RlflowEngine(model, dataclasses.replace(cfg, kv_cache=kv_cache),
                              mesh=one_device_mesh())
        batcher = ContinuousBatcher(engine)
        batcher.submit(Request(1, prompt, 3, dataclasses.replace(sampling,
                                                                 stop_token_ids=(stop,))))
        groups = batcher.step()                        # sample 0 done, sample 1 running
        assert batcher.num_active == 1
        batcher.update_params(w1, version=1)
        while batcher.has_work:
            groups += batcher.step()
        assert batcher.counters.stale_prefixes_dropped == 1
        out[kv_cache] = {g.prompt_id: g for g in groups}
    assert_same_completions(model, out["paged"], out["contiguous"])
    versions = [c.versions for c in out["paged"][1].completions]
    assert (versions[1] == 0).any() and (versions[1] == 1).any() and (versions[2] == 1).all()
