"""Weight transfer (jax.experimental.transfer + coordinator) and the orbax folder fallback.

The two-process tests run this file as a script for the learner side (``python
tests/unit/exchange/test_transfer.py learner [DEVICES [LAYOUT]]``, default 2 fake CPU devices) with the
pytest process (4 fake devices) as the sampler, or with a second script process as the
sampler (``python tests/unit/exchange/test_transfer.py sampler DEVICES ADDRESS OUT_DIR``) when the sampler
needs a device count of its own.
"""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

PEER_DEVICES = 2


def expected(version):
    """Numpy oracle of the params the peer learner publishes at ``version``."""
    return {
        "embed": (np.arange(16 * 8, dtype=np.float32).reshape(16, 8) * (version + 1)),
        "layers": [{"w": (np.arange(64, dtype=np.float32).reshape(8, 8) - version) / 8},
                   {"w": np.full((8, 8), version, np.float32)}],
        "scale": np.float32(0.5 * version),
    }


def learner_peer(devices=PEER_DEVICES, layout="native"):
    """The learner process: publish v1, then v2 on "next", exit on "quit"."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from rlflow.exchange.coordinator import Coordinator
    from rlflow.exchange.transfer import WeightPublisher

    assert len(jax.devices()) == devices
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    shard = {"embed": P("fsdp", None), "w": P(None, "fsdp")}

    def params(v):
        e = expected(v)
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
        return {"embed": put(e["embed"], shard["embed"]),
                "layers": [{"w": put(layer["w"], shard["w"])} for layer in e["layers"]],
                "scale": jax.device_put(e["scale"], jax.devices()[-1])}

    pub = WeightPublisher(pull_timeout_s=60, layout=layout)
    coord = Coordinator(pub).start()
    pub.publish(1, params(1))
    print("READY", coord.address, flush=True)
    for line in sys.stdin:
        if line.strip() == "next":
            pub.publish(2, params(2))
            print("PUBLISHED 2", flush=True)
        elif line.strip() == "quit":
            break
    coord.close()


def sampler_peer(devices, address, out_dir):
    """A sampler process with its own device count: on "pull", poll the coordinator, lay the
    weights onto a mesh over all its devices, save them to ``OUT_DIR/v<version>.npz`` and
    print "PULLED <version> <devices of each leaf>"; exit on "quit"."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from rlflow.exchange.transfer import WeightSubscriber

    assert len(jax.devices()) == devices
    mesh = Mesh(np.array(jax.devices()), ("data",))
    s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    target = {"embed": s("data"), "layers": [{"w": s(None, "data")}, {"w": s()}],
              "scale": s()}
    sub = WeightSubscriber(address, consumer_id=f"sampler-{devices}", target=target,
                           timeout_s=60, retries=0)
    for line in sys.stdin:
        if line.strip() == "pull":
            v, params = sub.poll()
            flat = {jax.tree_util.keystr(p): x for p, x in
                    jax.tree_util.tree_flatten_with_path(params)[0]}
            np.savez(os.path.join(out_dir, f"v{v}.npz"),
                     **{k: np.asarray(x) for k, x in flat.items()})
            counts = sorted({len(x.sharding.device_set) for x in flat.values()})
            print("PULLED", v, *counts, flush=True)
        elif line.strip() == "quit":
            break
    sub.close()


if __name__ == "__main__" and sys.argv[1:2] == ["learner"]:
    learner_peer(*[int(a) if a.isdigit() else a for a in sys.argv[2:]])
    sys.exit(0)
if __name__ == "__main__" and sys.argv[1:2] == ["sampler"]:
    sampler_peer(int(sys.argv[2]), *sys.argv[3:])
    sys.exit(0)

import jax  # noqa: E402  (the peer sets its device count through the environment first)
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from rlflow.exchange import layout as layout_lib  # noqa: E402
from rlflow.exchange.coordinator import Coordinator, CoordinatorClient  # noqa: E402
from rlflow.exchange.orbax_fallback import OrbaxWeightPublisher, OrbaxWeightSubscriber  # noqa
from rlflow.exchange.transfer import (WeightPublisher, WeightPullCancelled,  # noqa: E402
                                      WeightSubscriber, WeightTransferError,
                                      WeightTransferTimeout)
from rlflow.sampler.background import WeightPuller  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def sampler_target():
    """The sampler's own layout: a 2x2 mesh with shardings unlike the learner's."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    return {"embed": s(None, "tensor"), "layers": [{"w": s("data", None)}, {"w": s()}],
            "scale": s()}


def assert_params_equal(got, want, target):
    leaves_got = jax.tree.leaves(got)
    leaves_want = jax.tree.leaves(want)
    assert len(leaves_got) == len(leaves_want)
    for g, w, t in zip(leaves_got, leaves_want, jax.tree.leaves(target)):
        np.testing.assert_array_equal(np.asarray(g), w)
        assert g.sharding == t


def _peer(role, devices, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.Popen([sys.executable, __file__, role, str(devices), *map(str, args)],
                            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def _say(peer, line):
    peer.stdin.write(line + "\n")
    peer.stdin.flush()


def _stop(*peers):
    for p in peers:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_two_processes_pull_two_versions():
    peer = _peer("learner", PEER_DEVICES)
    try:
        line = peer.stdout.readline().split()
        assert line[:1] == ["READY"], line
        target = sampler_target()
        sub = WeightSubscriber(line[1], consumer_id="sampler-0", target=target, timeout_s=60)
        versions = []
        v, params = sub.poll()
        versions.append(v)
        assert_params_equal(params, expected(1), target)
        assert sub.poll() is None  # nothing newer: no uuid spent
        peer.stdin.write("next\n")
        peer.stdin.flush()
        assert peer.stdout.readline().split() == ["PUBLISHED", "2"]
        v, params = sub.poll()
        versions.append(v)
        assert_params_equal(params, expected(2), target)
        assert versions == [1, 2] and sub.metrics["pulls"] == 2
        sub.close()
        peer.stdin.write("quit\n")
        peer.stdin.flush()
        assert peer.wait(60) == 0
    finally:
        _stop(peer)


@pytest.mark.slow
@pytest.mark.parametrize("learner_devices,sampler_devices,layout", [
    (2, 1, "single_device"),  # fewer sampler devices (aborted the sampler before the fix)
    (1, 2, "native"),         # more sampler devices
])
def test_different_device_counts_pull_two_versions(tmp_path, learner_devices,
                                                   sampler_devices, layout):
    """Learner and sampler as two script processes with different device counts: both
    versions arrive equal to the oracle, laid onto all of the sampler's devices."""
    learner, sampler = _peer("learner", learner_devices, layout), None
    try:
        line = learner.stdout.readline().split()
        assert line[:1] == ["READY"], line
        sampler = _peer("sampler", sampler_devices, line[1], tmp_path)
        for v in (1, 2):
            if v == 2:
                _say(learner, "next")
                assert learner.stdout.readline().split() == ["PUBLISHED", "2"]
            _say(sampler, "pull")
            # a process abort shows up here as an empty line
            assert sampler.stdout.readline().split() == ["PULLED", str(v),
                                                         str(sampler_devices)]
            got = np.load(tmp_path / f"v{v}.npz")
            want = expected(v)
            np.testing.assert_array_equal(got["['embed']"], want["embed"])
            for i in range(2):
                np.testing.assert_array_equal(got[f"['layers'][{i}]['w']"], want["layers"][i]["w"])
            np.testing.assert_array_equal(got["['scale']"], want["scale"])
        _say(sampler, "quit")
        _say(learner, "quit")
        assert sampler.wait(60) == 0 and learner.wait(60) == 0
    finally:
        _stop(learner, sampler)


# ----------------------------------------------------------------- in-process pieces


@pytest.fixture
def learner():
    """Publisher + coordinator in this process (a second transfer server is the sampler)."""
    made = []

    def make(publisher=None, **kw):
        pub = publisher or WeightPublisher(pull_timeout_s=30, **kw)
        coord = Coordinator(pub).start()
        made.append(coord)
        return pub, coord

    yield make
    for c in made:
        c.close()


def sharded_params(version, devices=4):
    mesh = Mesh(np.array(jax.devices()[:devices]), ("fsdp",))
    e = expected(version)
    return {"embed": jax.device_put(e["embed"], NamedSharding(mesh, P("fsdp"))),
            "layers": [{"w": jax.device_put(x["w"], NamedSharding(mesh, P(None, "fsdp")))}
                       for x in e["layers"]],
            "scale": jax.device_put(e["scale"], jax.devices()[0])}


def stuck_offer(learner, timeout_s: float):
    """A subscriber with ``timeout_s`` and an offer of version 3 whose pull never completes
    (a uuid nobody called ``await_pull`` for)."""
    pub, coord = learner()
    pub.publish(3, sharded_params(3))
    sub = WeightSubscriber(coord.address, consumer_id="s0", timeout_s=timeout_s)
    offer = CoordinatorClient(coord.address, consumer_id="s1").latest(-1)
    return sub, dict(offer, uuid=offer["uuid"] ^ 1)


def test_stuck_pull_times_out_with_named_error(learner):
    sub, stuck = stuck_offer(learner, 0.3)
    with pytest.raises(WeightTransferTimeout, match=f"version 3 \\(uuid {stuck['uuid']}\\)"):
        sub.pull(stuck)
    assert sub.metrics["timeouts"] == 1


def test_cancel_ends_a_stuck_pull_and_refuses_later_polls(learner):
    sub, stuck = stuck_offer(learner, 600)
    timer = threading.Timer(0.2, sub.cancel)
    timer.start()
    # without the cancel this waits the whole 600 s watchdog, then raises the timeout
    with pytest.raises(WeightPullCancelled, match="version 3"):
        sub.pull(stuck)
    timer.join()
    assert sub.metrics["timeouts"] == 0
    with pytest.raises(WeightPullCancelled, match="a poll"):
        sub.poll()


class LosesFirstOffer(WeightPublisher):
    """A publisher whose first offer's await_pull never happens (a lost registration)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._real_server, self.lost = self._server, 0

    def offer(self, consumer, have_version):
        if self.lost == 0:
            self.lost += 1

            class NoAwait:
                def await_pull(self, *a, **k):
                    pass
            self._server = NoAwait()
            try:
                return super().offer(consumer, have_version)
            finally:
                self._server = self._real_server
        return super().offer(consumer, have_version)


def test_watchdog_retries_with_a_fresh_uuid(learner):
    pub, coord = learner(LosesFirstOffer(pull_timeout_s=30))
    pub.publish(1, sharded_params(1))
    target = sampler_target()
    sub = WeightSubscriber(coord.address, consumer_id="s0", target=target, timeout_s=0.3,
                           retries=1)
    v, params = sub.poll()
    assert v == 1
    assert_params_equal(params, expected(1), target)
    assert (sub.metrics["timeouts"], sub.metrics["failed_pulls"], pub.offers) == (1, 1, 2)


def test_retries_exhausted_raise_transfer_error(learner):
    pub, coord = learner(LosesFirstOffer(pull_timeout_s=30))
    pub.publish(1, sharded_params(1))
    sub = WeightSubscriber(coord.address, consumer_id="s0", timeout_s=0.3, retries=0)
    with pytest.raises(WeightTransferError, match="after 1 attempts") as e:
        sub.poll()
    assert isinstance(e.value.__cause__, WeightTransferTimeout)
    assert sub.version == -1
    assert sub.poll()[0] == 1  # the next poll gets a fresh offer and succeeds


def test_closing_the_puller_ends_its_thread_during_a_stuck_pull(learner):
    """The sampler's shutdown (``WeightPuller.close``) with a pull in flight from a learner
    that never serves it: the thread ends (its pull cancelled), with no error to re-raise."""
    pub, coord = learner(LosesFirstOffer(pull_timeout_s=30))
    pub.publish(1, sharded_params(1))
    sub = WeightSubscriber(coord.address, consumer_id="s0", timeout_s=600, retries=0)
    got = []
    puller = WeightPuller(sub, lambda *a: got.append(a))
    puller.request()
    while pub.offers == 0:             # the thread holds the lost offer: its pull is stuck
        time.sleep(0.01)
    puller.close()
    alive = [t.name for t in threading.enumerate() if t.name == "rlflow-weight-puller"]
    assert alive == [] and got == []
    puller.check()                     # a cancelled pull is not an error


@pytest.mark.parametrize("donated", [True, False])
def test_an_offer_outlives_a_newer_publish(learner, donated):
    """An offer made before a newer publish still delivers its own version's bytes, after the
    caller and the publisher have both dropped version 1: the server reads it through raw
    buffer aliases (the publish copy with ``donated``, the caller's own arrays without), and
    the freed memory of other arrays is then reused."""
    import gc

    pub, coord = learner(donated=donated)
    v1 = sharded_params(1)
    pub.publish(1, v1)
    offer = CoordinatorClient(coord.address, consumer_id="s1").latest(-1)
    pub.publish(2, sharded_params(2))
    del v1          # the caller drops version 1 too: only the offer holds its bytes now
    gc.collect()
    reuse = [jax.block_until_ready(jax.tree.map(lambda x: x * 3 + 1, sharded_params(7)))
             for _ in range(3)]
    sub = WeightSubscriber(coord.address, consumer_id="s0", timeout_s=30, retries=0)
    got = sub.pull(offer)
    want = jax.tree.leaves(expected(1))
    assert offer["version"] == 1 and len(got) == len(want) and len(reuse) == 3
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_a_kept_publish_is_sent_without_a_copy(learner):
    """``donated=False``: the published leaves are the caller's own arrays (no device copy);
    ``donated=True``: fresh copies."""
    params = sharded_params(3)
    for donated in (False, True):
        pub, _ = learner(donated=donated)
        pub.publish(1, params)
        sent = {id(x) for x in pub._current[1]}
        src = {id(x) for x in jax.tree.leaves(params)}
        assert len(sent) == len(src) == 4
        assert sent.isdisjoint(src) if donated else sent == src


def test_versions_never_go_backwards(learner, tmp_path):
    pub, _ = learner()
    pub.publish(5, sharded_params(5))
    with pytest.raises(ValueError, match="never go backwards: publishing 5 after 5"):
        pub.publish(5, sharded_params(5))
    opub = OrbaxWeightPublisher(str(tmp_path))
    opub.publish(2, sharded_params(2))
    with pytest.raises(ValueError, match="publishing 1 after 2"):
        opub.publish(1, sharded_params(1))
    opub.close()


def test_single_device_layout_reaches_a_one_device_sampler(learner):
    pub, coord = learner(layout="single_device")
    pub.publish(1, sharded_params(1, devices=4))
    one = jax.devices()[2:3]
    with pytest.raises(layout_lib.LayoutError, match="this process has 1 devices.*runtime.transfer_layout"):
        layout_lib.pull_avals(layout_lib.describe(
            *layout_lib.flatten(sharded_params(1))[:2]), one)
    sub = WeightSubscriber(coord.address, consumer_id="s0", devices=one, timeout_s=30)
    v, flat = sub.poll()  # no target: {path: array} in the published layout
    assert v == 1 and set(flat) == {"['embed']", "['layers'][0]['w']", "['layers'][1]['w']",
                                    "['scale']"}
    np.testing.assert_array_equal(np.asarray(flat["['embed']"]), expected(1)["embed"])
    assert flat["['embed']"].sharding.device_set == set(one)


def test_nnx_state_round_trip_and_target_mismatch(learner):
    pub, coord = learner()
    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    pub.publish(1, nnx.state(model, nnx.Param))
    other = nnx.Linear(8, 4, rngs=nnx.Rngs(1))  # the sampler's copy, different values
    sub = WeightSubscriber(coord.address, consumer_id="s0", target=nnx.state(other, nnx.Param))
    v, state = sub.poll()
    nnx.update(other, state)
    np.testing.assert_array_equal(np.asarray(other.kernel.value), np.asarray(model.kernel.value))
    pub.publish(2, nnx.state(model, nnx.Param))
    bad = nnx.state(nnx.Linear(8, 5, rngs=nnx.Rngs(0)), nnx.Param)
    sub.target = bad
    with pytest.raises(layout_lib.LayoutError, match=r"leaf \['bias'\].*\[5\].*\[4\]"):
        sub.poll()


def test_orbax_fallback_round_trip(tmp_path):
    run = str(tmp_path / "run")
    target = sampler_target()
    # the subscriber needs shapes too: ShapeDtypeStruct leaves carry them
    abstract = jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(np.shape(x), np.float32, sharding=s),
                            target, expected(0))
    sub = OrbaxWeightSubscriber(run, target=abstract)
    assert sub.poll() is None  # nothing published yet
    pub = OrbaxWeightPublisher(run, keep_last=2)
    pub.publish(1, sharded_params(1))
    v, params = sub.poll()
    assert v == 1
    assert_params_equal(params, expected(1), target)
    assert sub.poll() is None
    pub.publish(2, sharded_params(2))
    pub.publish(3, sharded_params(3))
    v, params = sub.poll()  # the newest, skipping 2
    assert v == 3
    assert_params_equal(params, expected(3), target)
    assert sorted(os.listdir(os.path.join(run, "weights"))) == ["2", "3"]
    # a restarted learner continues from the newest version on disk
    pub.close()
    assert OrbaxWeightPublisher(run).version == 3
    sub.close()


def test_subscriber_matches_the_publishers_transport_count(learner):
    """A puller whose transfer server has fewer bulk transports than the publisher's would
    abort: the subscriber starts its server with the advertised count, and restarts it for
    a publisher with more."""
    one = jax.devices()[:1]
    pub1, coord1 = learner(transports=1, layout="single_device")
    pub3, coord3 = learner(transports=3, layout="single_device")
    pub1.publish(1, sharded_params(1))
    pub3.publish(2, sharded_params(2))
    sub = WeightSubscriber(coord1.address, consumer_id="s0", devices=one, timeout_s=30)
    offers = [CoordinatorClient(c.address, consumer_id="s1").latest(-1) for c in (coord1, coord3)]
    assert [o["transports"] for o in offers] == [1, 3]
    for offer, v, transports in zip(offers, (1, 2), (1, 3)):
        arrays = sub.pull(offer)
        assert sub.transports == transports
        np.testing.assert_array_equal(np.asarray(arrays[0]), expected(v)["embed"])
    with pytest.raises(WeightTransferError, match="transports=None, expected an int"):
        sub.pull(dict(offers[0], transports=None))


def test_publish_copy_is_fresh_and_keeps_each_leafs_sharding():
    """The publisher's copy (one jitted call per device set): every leaf equal in value,
    dtype and sharding to its source, in buffers of its own (the train step may donate the
    source); leaves on other device sets and host arrays are copied too."""
    from rlflow.exchange.transfer import _copy_leaves

    mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    rng = np.random.default_rng(0)
    src = [jax.device_put(rng.standard_normal((4, 6)).astype(np.float32),
                          NamedSharding(mesh, P("fsdp", None))),
           jax.device_put(np.arange(6, dtype=np.int32), NamedSharding(mesh, P())),
           jax.device_put(np.float32(3.5), jax.devices()[1]),          # another device set
           rng.standard_normal((3,)).astype(np.float32)]              # a host array
    got = _copy_leaves(src)
    assert len(got) == len(src)
    for g, s in zip(got, src):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(s))
        assert g.dtype == s.dtype
        if isinstance(s, jax.Array):
            assert g.sharding == s.sharding
            src_ptrs = {b.data.unsafe_buffer_pointer() for b in s.addressable_shards}
            assert not src_ptrs & {b.data.unsafe_buffer_pointer() for b in g.addressable_shards}
        else:
            assert isinstance(g, jax.Array)
