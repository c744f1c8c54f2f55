"""Issue 53.1: a sampler's samples in flight journaled, the batcher dropped (as by kill -9),
and a new batcher resuming them from the journal file by re-prefill of prompt + tokens so
far: every group equals, token for token, the uninterrupted run's; nothing is decoded twice
past the journal write, and what was decoded after it is at most the interval per slot."""

import dataclasses

import numpy as np
import pytest

from rlflow.run import journal
from rlflow.sampler.batching import ContinuousBatcher
from rlflow.sampler.engine import RlflowEngine
from rlflow.sampler.sampling import SamplingError
from test_engine import one_device_mesh, random_model
from test_paged_kv import BASE, assert_same_completions, requests

CFG = dataclasses.replace(BASE, kv_cache="paged", page_size=4)
SEEDS = {r.prompt_id: 5000 + r.prompt_id for r in requests()}    # stand-in lease seeds


@pytest.fixture(scope="module")
def model():
    return random_model(scale=6.0, init_seed=1, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def engine(model):
    return RlflowEngine(model, CFG, mesh=one_device_mesh())


@pytest.fixture(scope="module")
def reference(engine):
    return {g.prompt_id: g for g in ContinuousBatcher(engine).run(requests())}


def _entries(partials):
    return [journal.JournalEntry(r.prompt_id, SEEDS[r.prompt_id], r.prompt_id, c.sample_index,
                                 c.tokens, c.logprobs, c.versions, c.finish_reason)
            for r, samples in partials for c in samples]


@pytest.mark.parametrize("write_at, lost_steps", [(2, 0), (3, 2), (5, 1)])
def test_killed_batcher_resumes_from_the_journal(model, engine, reference, tmp_path,
                                                 write_at, lost_steps):
    a = ContinuousBatcher(engine)
    for r in requests():
        a.submit(r)
    done = {}
    for _ in range(write_at):
        done.update({g.prompt_id: g for g in a.step()})
    partials = a.partials()     # groups it finishes by filing are journaled, not yet out
    used_at_write = a.counters.slot_steps_used
    journaled = _entries(partials)
    assert journaled and any(e.finish_reason == "" and e.tokens.size for e in journaled)
    # nothing decoded so far is missing from the journal and the groups already out
    assert used_at_write == sum(e.tokens.size for e in journaled) + sum(
        c.tokens.size for g in done.values() for c in g.completions)
    journal.write_journal(str(tmp_path), "sampler-0", journaled)
    for _ in range(lost_steps):           # decoded after the write, then the process dies
        a.step()
    lost = a.counters.slot_steps_used - used_at_write
    assert lost <= lost_steps * CFG.decode_steps_per_call * CFG.num_slots
    del a

    by_key, damaged = journal.read_journals(str(tmp_path))
    assert damaged == 0
    b = ContinuousBatcher(engine)
    for r in requests():
        if r.prompt_id not in done:       # the ledger hands the unfinished prompts back
            b.submit(r, resumed=[journal_completion(e) for e in
                                 by_key.get((r.prompt_id, SEEDS[r.prompt_id]), [])])
    while b.has_work:
        done.update({g.prompt_id: g for g in b.step()})
    assert_same_completions(model, done, reference)
    total = sum(c.tokens.size for g in reference.values() for c in g.completions)
    # the new batcher decoded exactly what the journal did not hold: nothing twice
    assert b.counters.slot_steps_used == total - used_at_write
    assert b._pool.num_free == b._pool.num_pages
    assert not b._queue and not b.has_work


def journal_completion(e):
    from rlflow.sampler.requests import Completion
    return Completion(e.prompt_id, e.sample_index, e.tokens, e.logprobs, e.versions,
                      e.finish_reason)


def test_bad_resumed_samples_are_refused_with_the_prompt_named(model, engine):
    r = requests()[0]
    b = ContinuousBatcher(engine)
    from rlflow.sampler.requests import Completion
    z = np.zeros(r.sampling.max_tokens, np.int32)
    with pytest.raises(ValueError, match=f"prompt_id {r.prompt_id} sample 0"):
        b.submit(r, resumed=[Completion(r.prompt_id, 0, z, z.astype(np.float32), z, "")])
    with pytest.raises(ValueError, match="index 7"):
        b.submit(r, resumed=[Completion(r.prompt_id, 7, z[:1], z[:1].astype(np.float32),
                                        z[:1], "")])
    contiguous = ContinuousBatcher(RlflowEngine(model, BASE, mesh=one_device_mesh()))
    with pytest.raises(SamplingError, match="paged"):
        contiguous.submit(r, resumed=[Completion(r.prompt_id, 0, z[:1],
                                                 z[:1].astype(np.float32), z[:1], "")])
