"""Weight fan-out over a relay tree (rlflow.exchange.relay): the offer rules against a fake
publisher, and real pulls by 4 replica processes through jax.experimental.transfer."""

import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def expected(version):
    """Numpy oracle of the params published at ``version``."""
    rng = np.random.default_rng(version)
    return {"embed": rng.standard_normal((64, 32)).astype(np.float32),
            "w": [rng.standard_normal((32, 32)).astype(np.float32) for _ in range(3)]}


def serve_pulls(client, name, out_dir, extra=lambda: ()):
    """A replica process's loop: on "pull", poll ``client`` until it holds a newer version
    (a relay may make it wait), save it ({path or name: array}) to
    OUT_DIR/<name>-v<version>.npz and print PULLED <version> [extra()...]; "quit" ends it."""
    import time

    for line in sys.stdin:
        if line.strip() == "pull":
            have = client.version
            while True:
                got = client.poll()
                if got is not None and got[0] > have:
                    break
                time.sleep(0.02)
            v, params = got
            np.savez(os.path.join(out_dir, f"{name}-v{v}.npz"),
                     **{k: np.asarray(x) for k, x in params.items()})
            print("PULLED", v, *extra(), flush=True)
        elif line.strip() == "quit":
            break
    client.close()


def replica_peer(name, address, out_dir):
    """A replica process (1 device) of a one-host learner, relaying with fan-out 2; its
    PULLED line adds the failed pulls so far."""
    from rlflow.exchange.transfer import WeightSubscriber

    sub = WeightSubscriber(address, consumer_id=name, timeout_s=5, retries=3,
                           relay_fanout=2, relay_timeout_s=60)
    serve_pulls(sub, name, out_dir, extra=lambda: [sub.metrics["failed_pulls"]])


def host_units_oracle(version):
    """Numpy oracle of a 2-host learner's params at ``version``: ``w`` split by rows
    between the hosts, ``b`` on host 1 only (what ``host_shards.host_units`` gives)."""
    rng = np.random.default_rng(100 + version)
    return {"b": rng.standard_normal(16).astype(np.float32),
            "w": rng.standard_normal((48, 16)).astype(np.float32)}


def host_units_of(version, host):
    """Learner host ``host``'s unit of :func:`host_units_oracle` (flatten order b, w)."""
    from rlflow.exchange.host_shards import unit_key

    p = host_units_oracle(version)
    if host == 0:
        return {unit_key(1, ((0, 24), (0, 16))): p["w"][:24]}
    return {unit_key(0, ((0, 16),)): p["b"], unit_key(1, ((24, 48), (0, 16))): p["w"][24:]}


def replica_of_hosts_peer(name, addresses, out_dir):
    """A replica process (1 device) of a 2-host learner: pulls both hosts' units (relaying
    each, fan-out 2) and assembles them, as ``rlflow.sampler.subscribe`` does."""
    import jax

    from rlflow.exchange.host_shards import HostShardPuller
    from rlflow.exchange.transfer import WeightSubscriber

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
              for k, v in host_units_oracle(0).items()}
    puller = HostShardPuller([WeightSubscriber(a, consumer_id=name, timeout_s=5, retries=3,
                                               relay_fanout=2, relay_timeout_s=60)
                              for a in addresses.split(",")], target)
    serve_pulls(puller, name, out_dir)


if __name__ == "__main__" and sys.argv[1:2] == ["replica"]:
    replica_peer(*sys.argv[2:])
    sys.exit(0)
if __name__ == "__main__" and sys.argv[1:2] == ["replica_of_hosts"]:
    replica_of_hosts_peer(*sys.argv[2:])
    sys.exit(0)

from rlflow.exchange.relay import RelayOffers  # noqa: E402


class _FakePublisher:
    nbytes = 100
    layout_desc = {"leaves": []}

    def __init__(self):
        self.version, self.offers = -1, 0

    def offer(self, consumer, have_version):
        if self.version <= have_version:
            return {"version": self.version}
        self.offers += 1
        return {"version": self.version, "address": "learner:1", "uuid": self.offers,
                "transports": 1, "layout": self.layout_desc}


class _Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_offer_rules_learner_fanout_then_relays_then_fallback():
    pub, clock = _FakePublisher(), _Clock()
    relay = RelayOffers(pub, fanout=2, assign_timeout_s=10, clock=clock)
    assert relay.offer("a", -1) == {"version": -1}
    pub.version = 0
    assert relay.offer("a", -1)["source"] == "learner"
    assert relay.offer("b", -1)["source"] == "learner"
    assert relay.offer("c", -1) == {"version": 0, "wait": True}   # a and b still pulling
    assert relay.register("a", 0, "a:7", 2, [11, 12])
    got = [relay.offer(c, -1) for c in ("c", "d")]
    assert [(o["address"], o["uuid"], o["transports"]) for o in got] == [("a:7", 12, 2),
                                                                      ("a:7", 11, 2)]
    assert relay.offer("e", -1) == {"version": 0, "wait": True}   # b, c, d pulling
    # c's pull from a failed (a died): a is struck off; b and d still pull: wait
    assert relay.offer("c", -1, failed="a:7") == {"version": 0, "wait": True}
    clock.t = 11.0                                    # every pull handed out is now too old
    assert relay.offer("c", -1)["source"] == "learner"  # nothing under way: the learner serves
    assert relay.learner_bytes_by_version == {0: 300}
    assert relay.bytes_sent == {"learner": 300, "a": 200}
    assert relay.offer("a", 0) == {"version": 0}      # current: nothing to pull
    assert not relay.register("b", -1, "b:1", 1, [1])  # an old version is not registered
    pub.version = 1                                   # a new version starts a new tree
    assert relay.offer("e", 0)["source"] == "learner"
    assert relay.metrics()["transfer/learner_bytes_last_version"] == 100
    assert relay.totals().tolist() == [400, 200, 100, 100, relay.waits]


def test_all_hosts_relay_metrics_sum_each_host_tree():
    """A 2-host learner: each host's tree (here: different traffic) adds up, and the
    egress per model is the learner's last-version bytes over the sum of the hosts' shards."""
    from rlflow.exchange.relay import TOTALS, all_hosts_metrics

    trees = []
    for nbytes, consumers in ((100, "abc"), (60, "abcd")):
        pub = _FakePublisher()
        pub.nbytes, pub.version = nbytes, 0
        relay = RelayOffers(pub, fanout=2, assign_timeout_s=10, clock=_Clock())
        relay.offer(consumers[0], -1)
        relay.offer(consumers[1], -1)
        relay.register(consumers[0], 0, "x:1", 1, list(range(len(consumers) - 2)))
        for c in consumers[2:]:
            relay.offer(c, -1)
        trees.append(relay)
    rows = np.stack([r.totals() for r in trees])
    m = all_hosts_metrics(rows)
    # oracle from each tree's own counters
    learner = [r.bytes_sent["learner"] for r in trees]
    relayed = [sum(r.bytes_sent.values()) - r.bytes_sent["learner"] for r in trees]
    assert (learner, relayed) == ([200, 120], [100, 120])
    assert m["transfer/bytes_sent/learner"] == 320 and m["transfer/bytes_sent/relays"] == 220
    assert m["transfer/learner_bytes_last_version"] == 320
    assert m["transfer/learner_egress_per_model"] == pytest.approx(320 / 160)
    assert (m["transfer/host/0/learner_bytes_last_version"],
            m["transfer/host/1/learner_bytes_last_version"]) == (200, 120)
    assert all_hosts_metrics(np.zeros((2, len(TOTALS)))) == {}      # star: no relay figures
    with pytest.raises(ValueError, match="rows must be"):
        all_hosts_metrics(np.zeros((2, 3)))


def test_demand_driven_relays_register_only_needed_slots():
    pub, clock = _FakePublisher(), _Clock()
    relay = RelayOffers(pub, fanout=2, assign_timeout_s=10, num_consumers=4, clock=clock)
    pub.version = 0
    a, b = relay.offer("a", -1), relay.offer("b", -1)
    assert (a["source"], a["relay"], b["source"], b["relay"]) == ("learner", 2, "learner", 0)
    assert relay.offer("c", -1) == {"version": 0, "wait": True}    # a will serve 2
    assert relay.register("a", 0, "a:7", 1, [11, 12])
    c, d = relay.offer("c", -1), relay.offer("d", -1)
    assert (c["source"], c["relay"], d["source"], d["relay"]) == ("a", 0, "a", 0)
    assert relay.learner_bytes_by_version == {0: 200}               # 2x the model for 4


def _replica(name, address, out_dir, role="replica"):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    return subprocess.Popen([sys.executable, __file__, role, name, address, str(out_dir)],
                            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


@pytest.mark.slow
def test_four_replicas_learner_egress_and_bitwise_equal_with_a_dead_relay(tmp_path):
    """4 replica processes pull versions 1 and 2 through the relay tree: the learner sends
    at most 2x the model's bytes per version, and every replica holds the learner's arrays
    bit for bit. For version 2 a relay that never serves (a dead one: its uuids are never
    pulled) is registered first: the replicas sent to it time out, retry naming it, and
    get another source."""
    import jax

    from rlflow.exchange.coordinator import Coordinator, CoordinatorClient
    from rlflow.exchange.transfer import WeightPublisher

    pub = WeightPublisher(pull_timeout_s=60, layout="single_device")
    relay = RelayOffers(pub, fanout=2, assign_timeout_s=60, num_consumers=4)
    coord = Coordinator(relay).start()
    names = [f"sampler-{i}" for i in range(4)]
    peers = [_replica(n, coord.address, tmp_path) for n in names]
    try:
        for version in (1, 2):
            pub.publish(version, jax.tree.map(jax.numpy.asarray, expected(version)))
            if version == 2:
                ghost = CoordinatorClient(coord.address, consumer_id="ghost")
                assert ghost.register(version=2, address=pub.address, transports=1,
                                      uuids=[1234567, 7654321])
                ghost.close()
            for p in peers:
                p.stdin.write("pull\n")
                p.stdin.flush()
            lines = [p.stdout.readline().split() for p in peers]
            assert all(line[:2] == ["PULLED", str(version)] for line in lines), lines
            if version == 1:
                assert relay.learner_bytes_by_version[version] <= 2 * pub.nbytes
                relayed = sum(v for k, v in relay.bytes_sent.items() if k != "learner")
                assert relayed == 2 * pub.nbytes          # the other 2 from replicas
            for n in names:
                got = np.load(os.path.join(tmp_path, f"{n}-v{version}.npz"))
                want = expected(version)
                flat = {"['embed']": want["embed"],
                        **{f"['w'][{i}]": w for i, w in enumerate(want["w"])}}
                assert sorted(got.files) == sorted(flat)
                for k, w in flat.items():
                    np.testing.assert_array_equal(got[k], w)      # bit for bit
        assert sum(int(line[2]) for line in lines) >= 1          # the ghost's children failed
    finally:
        _quit(peers)
        coord.close()


def _quit(peers):
    """Tell every replica process to quit, then wait for them all (killing a stuck one)."""
    for p in peers:
        try:
            p.stdin.write("quit\n")
            p.stdin.flush()
        except OSError:                 # already gone
            pass
    for p in peers:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.mark.slow
def test_each_host_of_a_multi_host_learner_relays_its_shards(tmp_path):
    """A 2-host learner (two publishers, each serving its own shards behind its own relay
    tree, as rlflow.learner.hosts sets them up) and 4 replica processes pulling from both:
    each host sends at most fan-out (2) x its shards' bytes per version, the other 2 pulls
    of each host's shards come from replicas, and every replica assembles the learner's
    params bit for bit."""
    import jax

    from rlflow.exchange.coordinator import Coordinator
    from rlflow.exchange.transfer import WeightPublisher

    pubs = [WeightPublisher(pull_timeout_s=60, layout="single_device") for _ in range(2)]
    relays = [RelayOffers(p, fanout=2, assign_timeout_s=60, num_consumers=4) for p in pubs]
    coords = [Coordinator(r).start() for r in relays]
    names = [f"sampler-{i}" for i in range(4)]
    peers = [_replica(n, ",".join(c.address for c in coords), tmp_path, "replica_of_hosts")
             for n in names]
    try:
        for version in (1, 2):
            for host, pub in enumerate(pubs):
                pub.publish(version, {k: jax.numpy.asarray(v)
                                      for k, v in host_units_of(version, host).items()})
            for p in peers:
                p.stdin.write("pull\n")
                p.stdin.flush()
            lines = [p.stdout.readline().split() for p in peers]
            assert all(line == ["PULLED", str(version)] for line in lines), lines
            for pub, relay in zip(pubs, relays):
                assert relay.learner_bytes_by_version[version] <= 2 * pub.nbytes
            want = host_units_oracle(version)
            for n in names:
                got = np.load(os.path.join(tmp_path, f"{n}-v{version}.npz"))
                assert sorted(got.files) == sorted(want)
                for k, w in want.items():
                    np.testing.assert_array_equal(got[k], w)      # bit for bit
        for pub, relay in zip(pubs, relays):      # 2 versions x 2 relayed pulls per host
            relayed = sum(v for k, v in relay.bytes_sent.items() if k != "learner")
            assert relayed == 2 * 2 * pub.nbytes
    finally:
        _quit(peers)
        for c in coords:
            c.close()
