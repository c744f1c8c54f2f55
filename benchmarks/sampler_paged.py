"""Sequences in flight at a fixed KV-cache budget: the paged cache against the contiguous one
(issue 43 item 5, acceptance: paged / contiguous >= 3).

Long-tailed completions: lengths drawn lognormal with median PAGED_BENCH_MEDIAN [1024]
tokens and sigma PAGED_BENCH_SIGMA [1.0], cut at PAGED_BENCH_MAX [16384] (the sampler's
``max_tokens``); prompts of PAGED_BENCH_PROMPT [256] tokens; PAGED_BENCH_REQUESTS [3000]
single-sample requests queued at once. The KV budget is PAGED_BENCH_KV_GIB [8] GiB of a
Qwen2.5-0.5B-shaped cache (24 layers x 2 KV heads x head dim 64, bfloat16: 12 KiB a token).

* contiguous: every slot reserves ``prompt + max_tokens`` positions, so the budget holds
  ``budget / (bytes per token x (prompt + max))`` slots, all of them in flight while the
  queue is not empty;
* paged: a pool of ``budget / (bytes per token x P)`` pages (P = PAGED_BENCH_PAGE [16]),
  decode batch up to 16 x the contiguous slots; sequences are admitted while pages are
  free, grow page by page, and the latest admitted is preempted (and resumed later) when
  the pool runs out.

How: admission is simulated, not run. Real decode steps of 16K-token sequences do not fit
a 2-core host, and the model's size does not change how many sequences a budget holds.
The simulation drives rlflow's own :class:`rlflow.sampler.batching.ContinuousBatcher`
(its page allocator, admission, growth, preemption and resume code, unchanged) over a
stand-in engine whose decode call emits each sequence's next ``k`` (16) tokens and ends it
at its drawn length (a stop id), with no model. Sequences in flight are counted at every
decode step while requests are still queued (the steady state of a backlog).

Figures (``RESULT`` lines): ``contiguous_in_flight``, ``paged_in_flight``,
``paged_in_flight_over_contiguous`` (target >= 3), ``paged_preempted_fraction``
(preemptions per completion) and ``paged_recomputed_fraction`` (tokens re-prefilled on
resume per token generated).

A real decode at small scale beside it: a random model of the 4.46M GSM8K shape (hidden 256,
4 layers, vocab 2048), PAGED_BENCH_DECODE_SLOTS [16] slots, 64-token prompts, 64 new tokens
each, the same slots with either cache (pages of 16, a pool as large as the contiguous
cache): ``paged_decode_tokens_per_s_over_contiguous``, best of 2 after a warm-up, the
XLA-gather attention path's cost on this backend (0: skip it).
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np

MEDIAN = int(os.environ.get("PAGED_BENCH_MEDIAN", "1024"))
SIGMA = float(os.environ.get("PAGED_BENCH_SIGMA", "1.0"))
MAX = int(os.environ.get("PAGED_BENCH_MAX", "16384"))
PROMPT = int(os.environ.get("PAGED_BENCH_PROMPT", "256"))
REQUESTS = int(os.environ.get("PAGED_BENCH_REQUESTS", "3000"))
KV_GIB = float(os.environ.get("PAGED_BENCH_KV_GIB", "8"))
PAGE = int(os.environ.get("PAGED_BENCH_PAGE", "16"))
STEPS_PER_CALL = 16
DECODE_SLOTS = int(os.environ.get("PAGED_BENCH_DECODE_SLOTS", "16"))
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 24, 2, 64, 2          # Qwen2.5-0.5B, bfloat16
STOP = 1


def completion_lengths(n: int, seed: int = 0) -> np.ndarray:
    """``n`` lengths, lognormal (median ``MEDIAN``, sigma ``SIGMA``), in ``[1, MAX]``."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(MEDIAN), SIGMA, n)), 1, MAX).astype(int)


class SimulatedEngine:
    """The engine calls the batcher makes, on host arrays, without a model: slot ``s``
    emits token 2 until its request's drawn length, then the stop id 1."""

    records_routing = False       # (a dense model: no expert choices to record)

    def __init__(self, cfg, lengths: np.ndarray):
        self.sampler_cfg = cfg
        self.paged = cfg.kv_cache == "paged"
        self.max_concurrent_decodes = self.num_slots = cfg.num_slots
        self.max_tokens = cfg.max_tokens
        self.decode_steps_per_call = cfg.decode_steps_per_call
        self.eos_token_ids = (STOP,)
        self.cfg = types.SimpleNamespace(vocab_size=8)
        self.buckets = tuple(cfg.prefill_buckets)
        self._lengths = lengths
        b = cfg.num_slots
        self._gen = np.zeros(b, int)
        self._target = np.zeros(b, int)
        self._active = np.zeros(b, bool)
        self.in_flight_steps = []                 # sequences in flight, per decode step
        self.recomputed = 0

    def load_params(self, params=None, version=0):
        return types.SimpleNamespace(version=version)

    def init_decode_state(self):
        return None

    def pad_prompt(self, tokens):
        return np.asarray(tokens), int(np.size(tokens))

    def prefill_batch(self, params, padded, lengths, samplings, sample_indices=None):
        return types.SimpleNamespace(length=np.asarray(lengths), routing=None)

    def insert_batch(self, prefix, state, rows, slots, sample_indices):
        for s in slots:
            self._gen[s], self._active[s] = 0, True
        return state

    def bind(self, batcher) -> None:
        """Each inserted slot's target length comes from its request (``prompt_id``)."""
        self._batcher = batcher

    def release(self, state, slot):
        self._active[slot] = False
        return state

    def set_page_table(self, state, table):
        return state

    def extend(self, params, state, slots, lasts, continuations):
        for s, c in zip(slots, continuations):
            self._gen[s] += len(c)
            self.recomputed += len(c)
        return state

    def generate_packed(self, params, state):
        b, k = self.num_slots, self.decode_steps_per_call
        for s, slot in enumerate(self._batcher._slots):
            if slot is not None and self._active[s]:
                self._target[s] = self._lengths[slot.live.request.prompt_id]
        packed = np.zeros((k, b, 6), np.int32)
        queued = self._batcher.num_queued > 0
        for j in range(k):
            act = self._active.copy()
            if queued:
                self.in_flight_steps.append(int(act.sum()))
            self._gen[act] += 1
            done = act & (self._gen >= self._target)
            packed[j, :, 0] = np.where(done, STOP, 2)
            packed[j, :, 1] = act
            packed[j, :, 2] = self._gen
            packed[j, :, 3] = done
            self._active &= ~done
        return state, _Host(packed)


class _Host:
    """A decode call's result as the batcher reads it (``np.asarray``, async copy)."""

    def __init__(self, packed):
        self._packed = packed

    def copy_to_host_async(self):
        pass

    def __array__(self, dtype=None, copy=None):
        return self._packed


def simulate(kv_cache: str, num_slots: int, num_pages: int, lengths: np.ndarray) -> dict:
    from rlflow.config import SamplerConfig
    from rlflow.sampler.batching import ContinuousBatcher, Request
    from rlflow.sampler.sampling import SamplingParams

    cfg = SamplerConfig(num_slots=num_slots, max_prefill_length=PROMPT,
                        prefill_buckets=(PROMPT,), max_tokens=MAX, group_size=1,
                        decode_steps_per_call=STEPS_PER_CALL, kv_cache=kv_cache,
                        page_size=PAGE, num_pages=num_pages)
    engine = SimulatedEngine(cfg, lengths)
    batcher = ContinuousBatcher(engine)
    engine.bind(batcher)
    batcher._extender = _Extender(engine)
    sp = SamplingParams(temperature=1.0, max_tokens=MAX, stop_token_ids=(STOP,))
    prompt = [3] * PROMPT
    groups = batcher.run([Request(i, prompt, 1, sp) for i in range(len(lengths))])
    got = sorted(len(g.completions[0].tokens) for g in groups)
    if got != sorted(lengths.tolist()):
        raise RuntimeError(f"{kv_cache}: completions lost or cut ({len(groups)} of "
                           f"{len(lengths)} requests back)")
    return dict(in_flight=float(np.mean(engine.in_flight_steps)),
                preemptions=batcher.counters.preemptions, recomputed=engine.recomputed)


class _Extender:
    """The batcher's append-prefill (``SlotExtender``) on the simulated engine."""

    def __init__(self, engine):
        self._engine = engine

    def max_length(self) -> int:
        return MAX

    def __call__(self, params, state, slots, lasts, continuations):
        return self._engine.extend(params, state, slots, lasts, continuations)


def decode_tokens_per_s(kv_cache: str) -> float:
    """Completion tokens per second of a real run (module doc), best of 2 after a warm-up."""
    import time

    import jax

    from rlflow.config import MeshConfig, ModelConfig, SamplerConfig
    from rlflow.mesh import make_mesh
    from rlflow.models import build_model
    from rlflow.sampler.batching import ContinuousBatcher, Request
    from rlflow.sampler.engine import RlflowEngine
    from rlflow.sampler.sampling import SamplingParams

    model = build_model(ModelConfig(hidden_size=256, num_layers=4, num_heads=4,
                                    num_kv_heads=2, head_dim=64, intermediate_size=1024,
                                    vocab_size=2048))[0]
    cfg = SamplerConfig(num_slots=DECODE_SLOTS, max_prefill_length=64, prefill_buckets=(64,),
                        max_tokens=64, kv_cache=kv_cache, page_size=16, decode_lanes=1)
    engine = RlflowEngine(model, cfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    rng = np.random.default_rng(0)
    reqs = [Request(i, rng.integers(1, 2048, 64).tolist(), 1, SamplingParams(
        temperature=1.0, max_tokens=64, seed=i, stop_token_ids=())) for i in range(DECODE_SLOTS)]
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        ContinuousBatcher(engine).run(reqs)
        best = max(best, DECODE_SLOTS * 64 / (time.perf_counter() - t0))
    return best


def main() -> int:
    token_bytes = 2 * LAYERS * KV_HEADS * HEAD_DIM * DTYPE_BYTES
    budget = KV_GIB * 2 ** 30
    contiguous_slots = int(budget // (token_bytes * (PROMPT + MAX)))
    pages = int(budget // (token_bytes * PAGE))
    if contiguous_slots < 1:
        raise SystemExit(f"PAGED_BENCH_KV_GIB={KV_GIB} holds no contiguous slot of "
                         f"{PROMPT + MAX} tokens")
    lengths = completion_lengths(REQUESTS)
    print(f"KV budget {KV_GIB} GiB = {budget / token_bytes:.0f} tokens of {token_bytes} B; "
          f"completions median {np.median(lengths):.0f} mean {lengths.mean():.0f} "
          f"max {lengths.max()} tokens; prompt {PROMPT}")
    c = simulate("contiguous", contiguous_slots, 0, lengths)
    p = simulate("paged", 16 * contiguous_slots, pages, lengths)
    ratio = p["in_flight"] / c["in_flight"]
    print(f"RESULT contiguous_in_flight {c['in_flight']:.1f} sequences | {contiguous_slots} "
          f"slots of {PROMPT + MAX} tokens")
    print(f"RESULT paged_in_flight {p['in_flight']:.1f} sequences | {pages} pages of {PAGE}")
    print(f"RESULT paged_in_flight_over_contiguous {ratio:.2f} x target>=3 | simulated "
          f"admission (rlflow's batcher and page allocator, no model)")
    print(f"RESULT paged_preempted_fraction {p['preemptions'] / REQUESTS:.3f} per completion")
    print(f"RESULT paged_recomputed_fraction {p['recomputed'] / lengths.sum():.4f} of "
          f"generated tokens")
    if DECODE_SLOTS:
        rates = {k: decode_tokens_per_s(k) for k in ("contiguous", "paged")}
        print(f"RESULT paged_decode_tokens_per_s_over_contiguous "
              f"{rates['paged'] / rates['contiguous']:.2f} x | {rates['paged']:.0f} vs "
              f"{rates['contiguous']:.0f} tokens/s, {DECODE_SLOTS} slots, real decode")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
