"""Rollout routing replay on the group record (rlflow.exchange.routing): schema, value
checks, both framings, the ring buffer over ZeroMQ, and the learner batch's row layout."""

import numpy as np
import pytest

from rlflow.exchange import records, routing
from rlflow.exchange.buffer import BufferClient, BufferServer
from rlflow.exchange.records import RecordError
from rlflow.exchange.ring import RingBuffer


def routed_group(seed=0, *, group_size=3, max_tokens=7, prompt_len=5, layers=2, top_k=2,
                 experts=8):
    rng = np.random.default_rng(seed)
    g = records.synthetic_group(rng, group_size=group_size, max_tokens=max_tokens,
                                prompt_len=prompt_len)
    return g | routing.synthetic_routing(rng, g, num_layers=layers, top_k=top_k,
                                         num_experts=experts)


def assert_same(a, b):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("experts,dtype", [(1, np.int8), (127, np.int8), (128, np.int16),
                                           (32767, np.int16)])
def test_routing_dtype_is_the_smallest_that_holds_the_ids(experts, dtype):
    assert routing.routing_dtype(experts) == np.dtype(dtype)


@pytest.mark.parametrize("experts", [0, 32768])
def test_routing_dtype_refuses_counts_it_cannot_hold(experts):
    with pytest.raises(ValueError, match=r"num_experts must be in \[1, 32767\]"):
        routing.routing_dtype(experts)


def test_record_version_3_validates_and_travels_in_both_framings():
    g = routed_group(experts=200)                      # int16 ids
    assert g["completion_routing"].dtype == np.int16
    dims = records.validate_group(g)
    assert (dims["L"], dims["k"]) == (2, 2)
    assert_same(records.decode_bytes(records.encode_bytes(g)), g)
    assert_same(records.decode_frames(records.encode_frames(g)), g)
    plain = {k: v for k, v in g.items() if k not in routing.ROUTING_FIELDS}
    extra = records.group_nbytes(g) - records.group_nbytes(plain)
    assert extra == (5 + 3 * 7) * 2 * 2 * 2            # (P + G T) L k, 2 bytes each


def test_routed_groups_round_trip_through_the_ring_buffer_over_zeromq():
    server = BufferServer(RingBuffer(4, timeout_s=60.0)).start()
    try:
        gs = [routed_group(seed=i) for i in range(2)]
        with BufferClient(server.address, timeout_s=60.0) as client:
            client.put_groups(gs)
        for want, got in zip(gs, server.get_groups(2, timeout=60.0)):
            assert_same(want, got)
    finally:
        server.close()


def _broken(change):
    g = routed_group()
    change(g)
    return g


@pytest.mark.parametrize("change,field,match", [
    (lambda g: g.pop("prompt_routing"), "prompt_routing", "missing"),
    (lambda g: g.update(completion_routing=g["completion_routing"].astype(np.int16)),
     "completion_routing", "dtype int8 like prompt_routing"),
    (lambda g: g.update(prompt_routing=g["prompt_routing"].astype(np.int32)),
     "prompt_routing", "dtype int8 or int16"),
    (lambda g: g.update(prompt_routing=g["prompt_routing"][:, :1]), "completion_routing",
     r"shape \[G, T, L, k\] with .*L=1"),
    (lambda g: g["completion_routing"].__setitem__((0, 6), 3), "completion_routing",
     "padding position"),
    (lambda g: g["prompt_routing"].__setitem__((0, 0, 0), -2), "prompt_routing", ">= 0"),
    (lambda g: g["prompt_routing"].__setitem__((0, 0, 0), -1), "prompt_routing",
     "or all -1"),
    (lambda g: g["prompt_routing"].__setitem__((1, 1), 4), "prompt_routing", "distinct"),
])
def test_bad_routing_names_the_field_and_what_was_expected(change, field, match):
    g = routed_group()
    g["completion_lengths"][0] = 4                     # position 6 of sample 0 is padding
    g["completion_routing"][0, 4:] = routing.NO_CHOICE
    records.validate_group(g)
    change(g)
    with pytest.raises(RecordError, match=match) as e:
        records.validate_group(g)
    assert e.value.field == field


def test_routing_rows_follow_the_batch_row_layout():
    g = routed_group(prompt_len=3)
    rows = routing.routing_rows(g, p_max=5, seq=14)
    want = np.full((3, 14, 2, 2), -1, np.int8)         # plain loop oracle
    for s in range(3):
        for c in range(3):
            want[s, 2 + c] = g["prompt_routing"][c]
        for c in range(7):
            want[s, 5 + c] = g["completion_routing"][s, c]
    np.testing.assert_array_equal(rows, want)
    assert rows.dtype == np.int8


# ------------------------------------------------------------------- learner batch layout

def _routed_records(seed, n_groups=2, group_size=4, max_tokens=6, layers=2, top_k=2):
    from learner_fixtures import make_group_records
    recs = make_group_records(seed, n_groups, vocab=64, group_size=group_size,
                              max_tokens=max_tokens)
    rng = np.random.default_rng(seed + 100)
    return [r | routing.synthetic_routing(rng, r, num_layers=layers, top_k=top_k,
                                          num_experts=8) for r in recs]


def _expected_ids(recs, tokens_attended, positions, group_ids, segment_ids, group_size):
    """Plain oracle: the ids of the token at each real position, from its record, by its
    position in its sequence (prompt first, then its sample's completion)."""
    want = np.full(positions.shape + (2, 2), -1, np.int8)
    for r, c in zip(*np.nonzero(tokens_attended)):
        gi = int(group_ids[r, c]) - 1
        if gi < 0:
            continue
        rec, p = recs[gi], int(positions[r, c])
        n_prompt = len(rec["prompt_tokens"])
        if p < n_prompt:
            want[r, c] = rec["prompt_routing"][p]
        else:
            sample = (int(segment_ids[r, c]) - 1) % group_size
            want[r, c] = rec["completion_routing"][sample, p - n_prompt]
    return want


def test_batch_and_packed_batch_carry_the_ids_of_each_token():
    from rlflow.learner.batch import BatchSpec, build_batch, row_segment_ids, validate_batch
    from rlflow.learner.packing import PackSpec, pack_batch

    recs = _routed_records(0)
    spec = BatchSpec(group_size=4, num_rows=10, seq_buckets=(16,), max_tokens=6)
    batch, info = build_batch(recs, spec, 0)
    validate_batch(batch)
    assert batch.routing_ids.shape == (10, 16, 2, 2) and info["batch/routed_samples"] == 8
    want = _expected_ids(recs, batch.attention_mask, batch.positions, batch.group_ids,
                         row_segment_ids(batch.attention_mask), 4)
    np.testing.assert_array_equal(batch.routing_ids, want)
    for shared in (False, True):
        packed, _ = pack_batch(batch, PackSpec.create(num_rows=10, max_row=16, pack_length=24,
                                                      buckets=2, split=1, shared_prefix=shared))
        validate_batch(packed)
        assert (packed.prefix_ids is None) if not shared else \
            (packed.prefix_ids != packed.segment_ids).any()
        # a shared prompt's own segment holds prompt positions only (its group's ids)
        want = _expected_ids(recs, packed.attention_mask, packed.positions, packed.group_ids,
                             packed.segment_ids, 4)
        np.testing.assert_array_equal(packed.routing_ids, want)


def test_records_without_routing_route_by_the_learner_and_shapes_must_agree():
    from rlflow.learner.batch import BatchError, BatchSpec, build_batch

    recs = _routed_records(1)
    spec = BatchSpec(group_size=4, num_rows=8, seq_buckets=(16,), max_tokens=6)
    plain = [{k: v for k, v in r.items() if k not in routing.ROUTING_FIELDS} for r in recs]
    assert build_batch(plain, spec, 0)[0].routing_ids is None
    mixed, _ = build_batch([recs[0], plain[1]], spec, 0)
    assert (mixed.routing_ids[4:] == -1).all() and (mixed.routing_ids[:4] >= 0).any()
    other = _routed_records(2, layers=3)
    with pytest.raises(BatchError, match=r"record 1 .*\[layers, k\] = \[3, 2\], record 0 "
                                         r"\[2, 2\]"):
        build_batch([recs[0], other[1]], spec, 0)
