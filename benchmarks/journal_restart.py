"""Tokens generated again after a sampler restart, with and without the journal of partial
generations (issue 53), and the journal's cost on the decode thread.

For completion lengths L = 1K, 2K, 4K, 8K tokens (each drawn uniform in ``[L/2, L]``),
JOURNAL_BENCH_SLOTS [64] single-sample requests decode in rlflow's own
:class:`rlflow.sampler.batching.ContinuousBatcher` (paged cache, its admission, preemption
and resume code unchanged) over the stand-in engine of ``benchmarks/sampler_paged.py`` (no
model: a decode call emits each sequence's next k = 16 tokens; 8K-token decodes of a real
model do not fit a 2-core host, and the model does not change what is lost). The replica is
killed at a decode call drawn uniform in the middle half of the run (seeded): what the
journal file holds at that moment is what a kill -9 leaves; then a new batcher finishes
every request:

* without the journal, every token of an unfinished request is generated again;
* with the journal, the sampler program's own :class:`rlflow.sampler.journal_keeper.
  JournalKeeper` runs after every decode call with N = JOURNAL_BENCH_EVERY [8]
  (``sampler.journal_every_steps``: a snapshot every N // 2 calls, written on its writer
  thread into a temporary run folder); the new batcher resumes each request from the file
  and generates again only what was decoded after the snapshot on disk (at most N x k per
  slot).

The figures are counted: tokens decoded by both batchers minus the tokens of the finished
completions, mean and max over 5 seeded kill points. Also measured (real time, this host,
median over the run's snapshots at the kill state): the snapshot on the decode thread (the
batcher's partials, copied, as entries: what the decode loop pays) and the write on the
writer thread (encode, atomic write), in ms and MB. The overhead on decode is the snapshot
time over the N // 2 decode calls between snapshots, of JOURNAL_BENCH_STEP_MS [30] ms each
(an assumed decode call time of a large model on an accelerator: the stand-in's calls take
no time); the writer thread's busy fraction of that interval says whether decoding would
wait for it (> 1). Printed::

    RESULT journal_regenerated_tokens_<L>_without <mean> (max <n>)
    RESULT journal_regenerated_tokens_<L>_with <mean> (max <n>; bound N x k x slots = <b>)
    RESULT journal_snapshot_ms_<L> <ms> ms on the decode thread; write <ms> ms ... (<MB> MB)
    RESULT journal_overhead_<L> <fraction> of decode at N=<N>, <ms> ms a call (N for < 2%:
        <n>; write thread busy <fraction> of the interval)

A real decode beside it (JOURNAL_BENCH_REAL_TOKENS [1024] new tokens, 0: skip): a random
model of the 4.46M GSM8K shape, 16 slots, the keeper after every decode call; the keeper's
decode-thread seconds over the decode calls' seconds, and tokens/s without and with::

    RESULT journal_overhead_real <fraction> of decode time on the decode thread (...)
    RESULT journal_decode_tokens_per_s <n> without, <n> with the journal (...)

Usage: ``python benchmarks/journal_restart.py`` (env: JOURNAL_BENCH_SLOTS, _EVERY, _STEP_MS,
_LENGTHS: comma-separated K values, default 1,2,4,8; _REAL_TOKENS).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sampler_paged import STOP, SimulatedEngine, _Extender  # noqa: E402

SLOTS = int(os.environ.get("JOURNAL_BENCH_SLOTS", "64"))
EVERY = int(os.environ.get("JOURNAL_BENCH_EVERY", "8"))
STEP_MS = float(os.environ.get("JOURNAL_BENCH_STEP_MS", "30"))
REAL_TOKENS = int(os.environ.get("JOURNAL_BENCH_REAL_TOKENS", "1024"))
LENGTHS = [int(x) * 1024 for x in os.environ.get("JOURNAL_BENCH_LENGTHS", "1,2,4,8").split(",")]
K = 16
PROMPT = 64
SEEDS = range(5)


def _batcher(cfg, lengths):
    from rlflow.sampler.batching import ContinuousBatcher

    engine = SimulatedEngine(cfg, lengths)
    batcher = ContinuousBatcher(engine)
    engine.bind(batcher)
    batcher._extender = _Extender(engine)
    return batcher


def _timed(fn, repeats: int = 5) -> float:
    """Median seconds of ``fn()``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run(length: int, journaled: bool, seed: int = 0) -> dict:
    from rlflow.config import SamplerConfig
    from rlflow.run import journal
    from rlflow.sampler.batching import Request
    from rlflow.sampler.journal_keeper import JournalKeeper
    from rlflow.sampler.requests import Completion
    from rlflow.sampler.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    lengths = rng.integers(length // 2, length + 1, SLOTS)
    cfg = SamplerConfig(num_slots=SLOTS, max_prefill_length=PROMPT, prefill_buckets=(PROMPT,),
                        max_tokens=length, group_size=1, decode_steps_per_call=K,
                        kv_cache="paged", page_size=16)
    sp = SamplingParams(temperature=1.0, max_tokens=length, stop_token_ids=(STOP,))
    requests = [Request(i, [3] * PROMPT, 1, sp) for i in range(SLOTS)]
    leases = {id(r): {"stream_index": r.prompt_id, "seed": 0} for r in requests}
    calls = int(np.ceil(lengths.max() / K))
    kill_at = int(rng.integers(calls // 4, 3 * calls // 4))
    a = _batcher(cfg, lengths)
    for r in requests:
        a.submit(r)
    done, out = {}, dict(snap_s=0.0, write_s=0.0, mb=0.0)
    with tempfile.TemporaryDirectory() as run_dir:
        keeper = JournalKeeper(run_dir, "sampler-0", EVERY, max_staleness=0) if journaled \
            else None
        for _ in range(kill_at):
            done.update({g.prompt_id: g for g in a.step()})
            if keeper is not None:
                keeper.after_step(a, leases)
        decoded_a = a.counters.slot_steps_used
        index = journal.read_journals(run_dir)[0] if journaled else {}   # what a kill leaves
        if keeper is not None:
            keeper.flush()
            entries = keeper._snapshot(a, leases, ())
            out["snap_s"] = _timed(lambda: keeper._snapshot(a, leases, ()))
            out["write_s"] = _timed(lambda: journal.write_journal(run_dir, "sampler-0", entries))
            out["mb"] = os.path.getsize(journal.journal_path(run_dir, "sampler-0")) / 2**20
            out["waits"] = keeper.counts["write_waits"]
    b = _batcher(cfg, lengths)
    for r in requests:
        if r.prompt_id in done:
            continue
        b.submit(r, resumed=[Completion(e.prompt_id, e.sample_index, e.tokens, e.logprobs,
                                        e.versions, e.finish_reason)
                             for e in index.get((r.prompt_id, 0), [])])
    while b.has_work:
        done.update({g.prompt_id: g for g in b.step()})
    got = sorted(len(done[i].completions[0].tokens) for i in range(SLOTS))
    if got != sorted(lengths.tolist()):
        raise RuntimeError(f"L={length}: completions lost or cut")
    out["regenerated"] = decoded_a + b.counters.slot_steps_used - int(lengths.sum())
    return out


def real_decode_overhead(tokens: int, slots: int = 16) -> dict:
    """A real decode with the keeper attached: a random model of the 4.46M GSM8K shape
    (hidden 256, 4 layers, vocab 2048, as ``benchmarks/sampler_paged.py``), ``slots``
    single-sample requests of 64-token prompts and ``tokens`` new tokens each (no stop),
    k = 16 tokens a decode call, paged cache. Returns the decode-thread seconds of the
    keeper over the seconds of the decode calls (``journal_overhead_real``), and the
    tokens/s of the same run without and with the journal (best of 2 each)."""
    import jax

    from rlflow.config import MeshConfig, ModelConfig, SamplerConfig
    from rlflow.mesh import make_mesh
    from rlflow.models import build_model
    from rlflow.sampler.batching import ContinuousBatcher, Request
    from rlflow.sampler.engine import RlflowEngine
    from rlflow.sampler.journal_keeper import JournalKeeper
    from rlflow.sampler.sampling import SamplingParams

    model = build_model(ModelConfig(hidden_size=256, num_layers=4, num_heads=4,
                                    num_kv_heads=2, head_dim=64, intermediate_size=1024,
                                    vocab_size=2048))[0]
    cfg = SamplerConfig(num_slots=slots, max_prefill_length=64, prefill_buckets=(64,),
                        max_tokens=tokens, kv_cache="paged", page_size=16, decode_lanes=1,
                        decode_steps_per_call=K)
    engine = RlflowEngine(model, cfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    rng = np.random.default_rng(0)
    reqs = [Request(i, rng.integers(1, 2048, 64).tolist(), 1, SamplingParams(
        temperature=1.0, max_tokens=tokens, seed=i, stop_token_ids=())) for i in range(slots)]
    leases = {id(r): {"stream_index": r.prompt_id, "seed": 0} for r in reqs}
    out = {"rate_without": 0.0, "rate_with": 0.0, "overhead": 1.0}
    for journaled in (False, True, False, True):
        with tempfile.TemporaryDirectory() as run_dir:
            keeper = JournalKeeper(run_dir, "sampler-0", EVERY, 0) if journaled else None
            batcher = ContinuousBatcher(engine)
            for r in reqs:
                batcher.submit(r)
            decode_s = journal_s = 0.0
            while batcher.has_work:
                t0 = time.perf_counter()
                batcher.step()
                t1 = time.perf_counter()
                if keeper is not None:
                    keeper.after_step(batcher, leases)
                decode_s += t1 - t0
                journal_s += time.perf_counter() - t1
            if keeper is not None:
                keeper.flush()
                out["overhead"] = min(out["overhead"], journal_s / decode_s)
            key = "rate_with" if journaled else "rate_without"
            out[key] = max(out[key], slots * tokens / (decode_s + journal_s))
    return out


def main() -> int:
    cadence = 1 if EVERY == 1 else EVERY // 2
    print(f"# {SLOTS} requests in flight, k={K} tokens per decode call, journal N={EVERY} "
          f"(a snapshot every {cadence} calls); stand-in engine (no model); kills at "
          f"{len(SEEDS)} seeded decode calls (mean, max); times on this host (median)")
    for length in LENGTHS:
        name = f"{length // 1024}K"
        without = [run(length, journaled=False, seed=s)["regenerated"] for s in SEEDS]
        runs = [run(length, journaled=True, seed=s) for s in SEEDS]
        with_ = [r["regenerated"] for r in runs]
        print(f"RESULT journal_regenerated_tokens_{name}_without {np.mean(without):.0f} "
              f"(max {max(without)})")
        print(f"RESULT journal_regenerated_tokens_{name}_with {np.mean(with_):.0f} (max "
              f"{max(with_)}; bound N x k x slots = {EVERY * K * SLOTS})")
        snap, write = (float(np.median([r[k] for r in runs])) * 1e3 for k in ("snap_s", "write_s"))
        mb = max(r["mb"] for r in runs)
        print(f"RESULT journal_snapshot_ms_{name} {snap:.2f} ms on the decode thread; write "
              f"{write:.1f} ms on the writer thread ({mb:.2f} MB)")
        frac = snap / (cadence * STEP_MS)
        need = 2 * int(np.ceil(snap / (0.02 * STEP_MS)))     # snapshots every N // 2 calls
        print(f"RESULT journal_overhead_{name} {frac:.4f} of decode at N={EVERY}, {STEP_MS:.0f} "
              f"ms a call (N for < 2%: {need}; write thread busy "
              f"{write / (cadence * STEP_MS):.2f} of the interval)")
    if REAL_TOKENS:
        r = real_decode_overhead(REAL_TOKENS)
        print(f"RESULT journal_overhead_real {r['overhead']:.4f} of decode time on the decode "
              f"thread (random 4.46M model, 16 slots x {REAL_TOKENS} tokens, k={K}, N={EVERY}, "
              f"this host's CPU; best of 2)")
        print(f"RESULT journal_decode_tokens_per_s {r['rate_without']:.0f} without, "
              f"{r['rate_with']:.0f} with the journal (best of 2; the same host, noisy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
