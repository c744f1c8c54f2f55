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


# ------------------------------------------------------------------ multi-turn episodes
G_EP, EP_TOKENS = 3, 16
EP_SEEDS = {0: 40, 1: 41}


class TallyRenderer:
    """Chat rendering of tests/episode_envs.py's ``Tally`` over the ids themselves: a turn's
    text is its ids (end-of-turn ids stripped), the environment's answer ``"c"`` renders as
    ``[3, 4 + c % 50, 9]`` (so each continuation depends on the environment's state)."""

    def __init__(self, eot):
        self.end_of_turn_ids = tuple(eot)

    def prompt_ids(self, messages, tools=None):
        return [1, 20, 33, 47]

    def assistant_text(self, ids):
        ids = [int(i) for i in ids]
        while ids and ids[-1] in self.end_of_turn_ids:
            ids.pop()
        return " ".join(map(str, ids))

    def continuation_ids(self, messages, new_messages, tools=None):
        assert messages[-1]["role"] == "assistant"
        return [3, 4 + int(new_messages[0]["content"]) % 50, 9]


def _episodes(engine, eot):
    """``(driver, batcher, requests)``: a fresh episode driver (``Tally`` environments, steps
    in this process), a batcher with it, and two prompts' requests of ``G_EP`` episodes."""
    from rlflow.config import EnvConfig
    from rlflow.sampler.episodes import EpisodeDriver
    from rlflow.sampler.requests import Request
    from rlflow.sampler.sampling import SamplingParams

    driver = EpisodeDriver(EnvConfig(name="episode_envs:make_tally", max_turns=4),
                           None, TallyRenderer(eot))
    reqs = []
    for pid, seed in EP_SEEDS.items():
        prompt, group = driver.new_group({"prompt_id": pid}, G_EP)
        reqs.append(Request(pid, prompt, G_EP, SamplingParams(
            temperature=1.0, max_tokens=EP_TOKENS, seed=seed, stop_token_ids=tuple(eot)),
            episode=group))
    return driver, ContinuousBatcher(engine, episodes=driver), reqs


@pytest.fixture(scope="module")
def episode_reference(engine):
    """``(eot, {prompt_id: group}, decode calls)`` of the uninterrupted episodes; the
    end-of-turn ids are ids the samples draw early, so that most episodes take 2-3 turns."""
    from rlflow.sampler.requests import Request
    from rlflow.sampler.sampling import SamplingParams

    single = ContinuousBatcher(engine).run([Request(0, [1, 20, 33, 47], G_EP, SamplingParams(
        temperature=1.0, max_tokens=EP_TOKENS, seed=EP_SEEDS[0], stop_token_ids=()))])[0]
    eot = sorted({int(c.tokens[1]) for c in single.completions})
    for second_turn in (True, False):         # then also ids the second turns draw early
        _, batcher, reqs = _episodes(engine, eot)
        for r in reqs:
            batcher.submit(r)
        groups, calls = {}, 0
        while batcher.has_work:
            groups.update({g.prompt_id: g for g in batcher.step()})
            calls += 1
        if second_turn:
            eot = sorted(set(eot) | {int(c.tokens[c.versions.tolist().index(-1) + 4])
                                     for g in groups.values() for c in g.completions})
    return eot, groups, calls


def test_episodes_resume_from_the_journal_inside_and_between_turns(
        model, engine, episode_reference, tmp_path):
    """Multi-turn episodes journaled after every decode call (the keeper, N = 1) and the
    batcher and its environments dropped (as by kill -9) after call 1, 3, 5, ...: a fresh
    driver and batcher resume them from the journal file (environments rebuilt by replaying
    the turns, re-prefill of prompt + ids so far), and every episode equals, token for token,
    the uninterrupted one (sync: one policy version, same seeds): ids, versions, loss mask,
    reward; nothing sampled twice. The cuts cover a sample inside a later turn (after the
    environment's ids), parked between turns, and a finished episode whose group still waits
    for the others."""
    from rlflow.sampler.journal_keeper import JournalKeeper

    eot, reference, calls = episode_reference
    sampled_total = sum(int((c.versions >= 0).sum()) for g in reference.values()
                        for c in g.completions)
    assert any(len(c.tokens) > 8 and (c.versions == -1).sum() >= 6
               for g in reference.values() for c in g.completions), "no episode of 3 turns"
    seen = set()
    for cut in range(1, calls - 1, 2):
        run = tmp_path / f"cut{cut}"
        _, a, reqs = _episodes(engine, eot)
        keeper = JournalKeeper(str(run), "sampler-0", every=1, max_staleness=0)
        leases = {id(r): {"stream_index": r.prompt_id, "seed": EP_SEEDS[r.prompt_id]}
                  for r in reqs}
        for r in reqs:
            a.submit(r)
        done = {}
        for _ in range(cut):
            done.update({g.prompt_id: g for g in a.step()})
            keeper.after_step(a, leases)
        used_at_write = a.counters.slot_steps_used
        for r, samples in a.partials():
            slots = {s.sample_index: s for s in a._slots if s is not None and s.live.request is r}
            for c in samples:
                if c.finish_reason:
                    seen.add("finished")
                elif c.sample_index in slots and slots[c.sample_index].parked:
                    seen.add("parked")
                else:
                    seen.add("inside a turn" if (c.versions == -1).any() else "first turn")
        del a

        driver, b, reqs = _episodes(engine, eot)
        again = JournalKeeper(str(run), "sampler-1", every=1, max_staleness=0)
        for r in reqs:
            if r.prompt_id not in done:      # the ledger hands the unfinished prompts back
                b.submit(r, resumed=again.resumed(
                    {"stream_index": r.prompt_id, "seed": EP_SEEDS[r.prompt_id]}, r, 0))
        while b.has_work:
            done.update({g.prompt_id: g for g in b.step()})
        assert_same_completions(model, done, reference)
        for pid, g in done.items():
            for c, want in zip(g.completions, reference[pid].completions):
                assert c.reward == want.reward and c.failed == want.failed, (cut, pid)
                assert c.loss_mask.tolist() == want.loss_mask.tolist()
        # what the journal held was not sampled again
        assert b.counters.slot_steps_used == sampled_total - used_at_write, cut
        m = driver.metrics()
        assert m["sampler/episodes_replay_mismatch"] == 0
        assert b._pool.num_free == b._pool.num_pages and not b.has_work
    assert seen >= {"inside a turn", "parked", "finished"}, seen


def test_an_episode_whose_replay_answers_otherwise_starts_over_counted(engine,
                                                                       episode_reference):
    """Journaled ids whose environment answer the replay does not render alike (another
    environment state) are not continued: the episode starts over from its prompt with a
    fresh environment, counted (``sampler/episodes_replay_mismatch``)."""
    from rlflow.sampler.episodes import EpisodeReplayError

    eot, reference, _ = episode_reference
    c = next(c for c in reference[0].completions if (c.versions == -1).any())
    driver, _, reqs = _episodes(engine, eot)
    group = reqs[0].episode
    n = int(np.flatnonzero(c.versions == -1)[-1]) + 1      # up to its last answer
    wrong = c.tokens[:n].copy()
    wrong[n - 2] += 1                                         # the count it answered, off
    with pytest.raises(EpisodeReplayError, match="journal holds 3 ids"):
        driver.resume(group, 0, wrong, c.versions[:n], eot)
    assert driver.metrics()["sampler/episodes_replay_mismatch"] == 1
    assert group.turns[0] == 0 and len(group.messages[0]) == 1 and group.envs[0].count == 0
    # the same ids as journaled: replayed, the turn after the answer not begun
    assert driver.resume(group, 0, c.tokens[:n], c.versions[:n], eot)[:2] == (n, False)
    assert driver.metrics()["sampler/episodes_resumed"] == 1
