"""Ring buffer of rollout groups: in-process ring, ZeroMQ server and producer client."""

import threading

import numpy as np
import pytest

from rlflow.config import BufferConfig
from rlflow.exchange import records, wire
from rlflow.exchange.buffer import BufferClient, BufferServer
from rlflow.exchange.records import RecordError
from rlflow.exchange.ring import BufferClosedError, BufferTimeoutError, ProducerError, RingBuffer

LONG = 60.0  # a wait that must never run out in a passing test


def group(version=0, prompt_id=0, seed=None, **kw):
    rng = np.random.default_rng(prompt_id if seed is None else seed)
    return records.synthetic_group(rng, version=version, prompt_id=prompt_id, **kw)


def assert_same(a, b):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture
def served():
    """Start a BufferServer; yields a factory; closes everything at the end."""
    made = []

    def make(capacity=8, when_full="block", **kw):
        server = BufferServer(RingBuffer(capacity, when_full=when_full, timeout_s=LONG), **kw)
        made.append(server.start())
        return server

    yield make
    for s in made:
        s.close()


def in_thread(fn, *args, **kw):
    """Run fn in a thread; returns a function that joins and returns its result or raises."""
    box = {}

    def run():
        try:
            box["out"] = fn(*args, **kw)
        except BaseException as e:  # handed to the test thread
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join():
        t.join(LONG)
        assert not t.is_alive(), "worker thread hung"
        if "err" in box:
            raise box["err"]
        return box.get("out")
    return join


# ---------------------------------------------------------------------------- in-process ring


def test_ring_fifo_whole_groups_and_metrics():
    ring = RingBuffer(4)
    gs = [group(prompt_id=i) for i in range(3)]
    for g in gs:
        ring.put(g, nbytes=records.group_nbytes(g))
    m = ring.metrics()
    assert (m["fill"], m["capacity"], m["fill_fraction"], m["put"]) == (3, 4, 0.75, 3)
    assert m["bytes_in"] == sum(records.group_nbytes(g) for g in gs)
    got = ring.get_groups(2, timeout=1)
    assert [g is h for g, h in zip(got, gs[:2])] == [True, True]
    assert ring.metrics()["got"] == 2 and len(ring) == 1


def test_ring_drop_oldest_counts():
    ring = RingBuffer(2, when_full="drop_oldest")
    for i in range(5):
        ring.put(group(prompt_id=i), timeout=0.01)
    assert ring.metrics()["dropped_full"] == 3
    assert [int(g["prompt_id"]) for g in ring.get_groups(2, timeout=1)] == [3, 4]


def test_ring_producer_timeout_names_consumer():
    ring = RingBuffer(1)
    ring.put(group())
    with pytest.raises(BufferTimeoutError, match="consumer .*stopped consuming") as e:
        ring.put(group(), timeout=0.05)
    assert e.value.stalled_side == "consumer"
    assert ring.metrics()["producer_wait_s"] > 0


def test_ring_consumer_timeout_names_producer_and_keeps_groups():
    ring = RingBuffer(4)
    ring.put(group(prompt_id=7))
    with pytest.raises(BufferTimeoutError, match="got 1.*producer .*stopped producing") as e:
        ring.get_groups(3, timeout=0.05)
    assert e.value.stalled_side == "producer"
    assert len(ring) == 1  # the group taken before the timeout went back
    assert int(ring.get_groups(1, timeout=1)[0]["prompt_id"]) == 7


def test_ring_blocked_producer_released_by_consumer():
    ring = RingBuffer(1)
    ring.put(group(prompt_id=1))
    join = in_thread(ring.put, group(prompt_id=2), timeout=LONG)
    assert int(ring.get_groups(1, timeout=LONG)[0]["prompt_id"]) == 1
    join()
    assert int(ring.get_groups(1, timeout=LONG)[0]["prompt_id"]) == 2


def test_ring_filter_that_raises_loses_no_group():
    ring = RingBuffer(4)
    for i in range(3):
        ring.put(group(prompt_id=i))

    def accept(g):
        if int(g["prompt_id"]) == 1:
            raise KeyError("bad filter")
        return True

    with pytest.raises(KeyError):
        ring.get_groups(3, timeout=1, accept=accept)
    assert [int(g["prompt_id"]) for g in ring.get_groups(3, timeout=1)] == [0, 1, 2]


def test_ring_close_wakes_waiters():
    ring = RingBuffer(1)
    join = in_thread(ring.get_groups, 1, timeout=LONG)
    ring.close()
    with pytest.raises(BufferClosedError):
        join()


# ---------------------------------------------------------------------------- over ZeroMQ


def test_put_over_zmq_round_trip(served):
    server = served()
    gs = [group(prompt_id=i, group_size=3, max_tokens=9) for i in range(3)]
    with BufferClient(server.address, timeout_s=LONG) as client:
        for g in gs:
            client.put_group(g)
        assert client.stats()["fill"] == 3
    for want, got in zip(gs, server.get_groups(3, timeout=LONG)):
        assert_same(want, got)
    assert server.metrics()["bytes_in"] == sum(records.group_nbytes(g) for g in gs)


def test_put_groups_batch_keeps_order_and_rejects_only_bad_records(served):
    server = served(capacity=8, group_size=3)
    gs = [group(prompt_id=i, group_size=3, max_tokens=9) for i in range(5)]
    bad_schema = dict(gs[1], rewards=gs[1]["rewards"].astype(np.float64))
    bad_dtype = dict(gs[3], truncated=np.array([object()] * 3))  # cannot travel
    with BufferClient(server.address, timeout_s=LONG, name="sampler-7") as client:
        rejected = client.put_groups([gs[0], bad_schema, gs[2], bad_dtype, gs[4]])
        assert sorted(rejected) == [1, 3]
        assert (rejected[1].field, rejected[1].expected, rejected[1].got) == (
            "rewards", "dtype float32", "dtype float64")
        assert "object" in rejected[3].got
        assert client.put_groups([]) == {}
        assert client.put_groups([gs[2]]) == {}
    got = server.get_groups(4, timeout=LONG)
    for want, g in zip([gs[0], gs[2], gs[4], gs[2]], got):
        assert_same(want, g)
    m = server.metrics()
    assert (m["put"], m["rejected"]) == (4, 1)  # bad_dtype never left the client
    assert "sampler-7 (group 1 of a batch)" in m["last_rejection"]


def test_put_groups_blocks_when_full_then_times_out_with_accepted_count(served):
    server = served(capacity=3)
    with BufferClient(server.address, timeout_s=LONG) as client:
        with pytest.raises(BufferTimeoutError, match="consumer") as e:
            client.put_groups([group(prompt_id=i) for i in range(5)], timeout=0.2)
        assert e.value.stalled_side == "consumer" and e.value.accepted == 3
        assert [int(g["prompt_id"]) for g in server.get_groups(3, timeout=LONG)] == [0, 1, 2]
        # a blocked batch completes, in order, as the consumer takes groups
        join = in_thread(client.put_groups, [group(prompt_id=10 + i) for i in range(5)])
        got = [int(g["prompt_id"]) for g in server.get_groups(5, timeout=LONG)]
        assert join() == {} and got == [10, 11, 12, 13, 14]
    assert server.metrics()["pending_puts"] == 0


def test_put_many_with_wrong_frame_counts_is_rejected(served):
    server = served()
    req = wire.Requester(server.address, name="buffer server")
    frames = records.encode_frames(group())
    for counts in ([len(frames) + 1], [0, len(frames)], "all"):
        meta = wire.dumps({"frames": counts})
        status, rest = req.request(b"put-many", [meta, *frames], timeout_s=LONG)
        assert status == b"rejected" and b"frame count" in rest[0].bytes
    req.close()
    assert server.metrics()["rejected"] == 3 and len(server.ring) == 0


def test_bad_record_rejected_with_named_error_and_server_keeps_running(served):
    server = served(group_size=4)
    with BufferClient(server.address, timeout_s=LONG, name="sampler-3") as client:
        bad = group()
        bad["behaviour_logprobs"] = bad["behaviour_logprobs"].astype(np.float16)
        with pytest.raises(RecordError) as e:
            client.put_group(bad)
        assert (e.value.field, e.value.expected, e.value.got) == (
            "behaviour_logprobs", "dtype float32", "dtype float16")
        with pytest.raises(RecordError, match="'completion_tokens'.*G=4"):
            wrong_g = group(group_size=2)
            client.put_group(wrong_g)
        client.put_group(group(prompt_id=5))  # the server is still serving
    m = server.metrics()
    assert (m["rejected"], m["put"]) == (2, 1)
    assert "sampler-3" in m["last_rejection"]
    assert int(server.get_groups(1, timeout=LONG)[0]["prompt_id"]) == 5


def test_malformed_frames_rejected_and_counted(served):
    server = served()
    req = wire.Requester(server.address, name="buffer server")
    status, rest = req.request(b"put", [b"{}", b"not a json header"], timeout_s=LONG)
    assert status == b"rejected" and b"JSON" in rest[0].bytes
    status, _ = req.request(b"put", [b"[1]"], timeout_s=LONG)
    assert status == b"rejected"
    status, rest = req.request(b"put", [b'{"timeout_s": "soon"}'], timeout_s=LONG)
    assert status == b"rejected" and b"timeout_s" in rest[0].bytes
    with pytest.raises(wire.ProtocolError):
        req.request(b"no-such-kind", [], timeout_s=LONG)
    req.close()
    assert server.metrics()["rejected"] == 3
    with BufferClient(server.address, timeout_s=LONG) as client:
        client.put_group(group())
    assert len(server.get_groups(1, timeout=LONG)) == 1


def test_remote_producer_blocks_when_full_then_times_out_naming_consumer(served):
    server = served(capacity=1)
    with BufferClient(server.address, timeout_s=LONG) as client:
        client.put_group(group(prompt_id=1))
        with pytest.raises(BufferTimeoutError, match="consumer") as e:
            client.put_group(group(prompt_id=2), timeout=0.2)
        assert e.value.stalled_side == "consumer"
        # a blocked put completes once the consumer takes a group
        join = in_thread(client.put_group, group(prompt_id=3))
        assert int(server.get_groups(1, timeout=LONG)[0]["prompt_id"]) == 1
        join()
    assert int(server.get_groups(1, timeout=LONG)[0]["prompt_id"]) == 3  # 2 was never added
    m = server.metrics()
    assert m["pending_puts"] == 0 and m["producer_wait_s"] > 0 and m["consumer_wait_s"] >= 0


def test_closed_buffer_and_failing_handler_keep_the_server_serving(served):
    class Flaky(BufferServer):
        def handle(self, identity, rid, kind, payload):
            if kind == b"stats" and not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("metrics backend down")
            return super().handle(identity, rid, kind, payload)

    server = Flaky(RingBuffer(2, timeout_s=LONG)).start()
    try:
        with BufferClient(server.address, timeout_s=LONG) as client:
            with pytest.raises(wire.RemoteError, match="metrics backend down"):
                client.stats()
            server.ring.close()  # the learner is shutting down
            with pytest.raises(BufferClosedError):
                client.put_group(group())
            assert client.stats()["put"] == 0  # still serving
    finally:
        server.close()
    assert server.error is None


def test_server_gone_producer_times_out(served):
    server = served()
    address = server.address
    server.close()
    with BufferClient(address, timeout_s=0.1, reply_grace_s=0.1) as client:
        with pytest.raises(BufferTimeoutError, match="stopped answering"):
            client.put_group(group())


def test_token_required_off_loopback_and_wrong_token_refused(served):
    with pytest.raises(ValueError, match="requires a shared token"):
        BufferServer(RingBuffer(2), bind_address="0.0.0.0")
    server = served(bind_address="0.0.0.0", token="s3cret")  # reached locally via 127.0.0.1
    port = server.port
    for token in ("", "wrong"):
        with BufferClient(f"tcp://127.0.0.1:{port}", token=token, timeout_s=LONG) as client:
            with pytest.raises(wire.PeerRefusedError, match="token"):
                client.put_group(group())
    with BufferClient(f"tcp://127.0.0.1:{port}", token="s3cret", timeout_s=LONG) as client:
        client.put_group(group(prompt_id=9))
    m = server.metrics()
    assert (m["refused"], m["put"]) == (2, 1)


def test_is_loopback():
    assert wire.is_loopback("127.0.0.1") and wire.is_loopback("127.0.0.2")
    assert wire.is_loopback("::1") and wire.is_loopback("localhost")
    for host in ("0.0.0.0", "*", "10.0.0.1", "example.org", "::"):
        assert not wire.is_loopback(host)


def test_config_requires_token_off_loopback():
    from rlflow.config import ConfigError, ExperimentConfig, RuntimeConfig

    with pytest.raises(ConfigError, match="buffer.token"):
        BufferConfig(bind_address="0.0.0.0")
    with pytest.raises(ConfigError, match="buffer.token.*runtime.bind_address='0.0.0.0'"):
        ExperimentConfig(runtime=RuntimeConfig(bind_address="0.0.0.0"))
    ExperimentConfig(runtime=RuntimeConfig(bind_address="0.0.0.0"),
                     buffer=BufferConfig(token="t"))
    with pytest.raises(ConfigError, match="runtime.transfer_layout"):
        RuntimeConfig(transfer_layout="sideways")


def test_from_config():
    cfg = BufferConfig(capacity=3, when_full="drop_oldest", timeout_s=7.0)
    server = BufferServer.from_config(cfg, group_size=4)
    try:
        assert (server.ring.capacity, server.ring.when_full, server.ring.timeout_s) == \
            (3, "drop_oldest", 7.0)
        assert server.address.startswith("tcp://127.0.0.1:")
    finally:
        server.close()


# ---------------------------------------------------------------------------- issue cases


def _at_least(version):
    return lambda g: records.policy_version_range(g)[0] >= version


@pytest.mark.parametrize("max_staleness, want_versions", [(0, [13] * 4), (1, [12] * 4)])
def test_staleness_deadlock_case(served, max_staleness, want_versions):
    """Learner at version 13 needs 4 groups; the sampler emits 4 tagged 12, then 4 tagged 13.

    The ring holds exactly 4: without dropping stale groups while waiting, the producer
    would block on a full ring of 12s forever.
    """
    server = served(capacity=4)

    def sampler():
        with BufferClient(server.address, timeout_s=LONG) as client:
            for v in (12, 13):
                for i in range(4):
                    client.put_group(group(version=v, prompt_id=10 * v + i))

    join = in_thread(sampler)
    got = server.get_groups(4, timeout=LONG, accept=_at_least(13 - max_staleness))
    assert [records.policy_version_range(g)[0] for g in got] == want_versions
    if max_staleness == 0:
        join()
        assert server.metrics()["dropped_filtered"] == 4
    else:
        assert server.metrics()["dropped_filtered"] == 0
        server.get_groups(4, timeout=LONG)  # drain the 13s so the sampler finishes
        join()


def test_producer_failing_at_every_retry_surfaces_at_consumer(served):
    """A sampler whose prompt raises at every retry reports it; the learner raises it instead of
    waiting out its (long) timeout."""
    server = served()

    def sampler():
        with BufferClient(server.address, timeout_s=LONG, name="sampler-0") as client:
            for attempt in range(3):
                try:
                    raise ValueError("reward function crashed on prompt 17")
                except ValueError as e:
                    last = e
            client.report_error(f"giving up after 3 retries: {last}")

    join = in_thread(sampler)
    with pytest.raises(ProducerError, match="sampler-0: giving up.*prompt 17"):
        server.get_groups(4, timeout=LONG)
    join()
    assert server.metrics()["producer_errors"] == 1
