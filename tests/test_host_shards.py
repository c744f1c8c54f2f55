"""Weights out of a multi-host learner: per-host transfer units, assembled by a sampler."""

import os
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rlflow.exchange.host_shards import (HostShardPuller, assemble, host_units,
                                         parse_unit_key, unit_key)
from rlflow.exchange.layout import LayoutError

TESTS = os.path.dirname(os.path.abspath(__file__))


def mesh(shape, axes):
    return jax.make_mesh(shape, axes, devices=jax.devices()[:int(np.prod(shape))])


def oracle():
    return {"w": np.arange(8 * 6, dtype=np.float32).reshape(8, 6) - 7.5,
            "b": np.linspace(-1, 1, 6).astype(np.float32),
            "s": np.float32(-0.0)}


def put(tree, m, specs):
    return {k: jax.device_put(v, NamedSharding(m, specs[k])) for k, v in tree.items()}


def test_units_partition_the_params_and_assemble_bitwise_on_another_layout():
    """fsdp=2 x tensor=2 params -> units (replicated shards once) -> a tensor=4 target."""
    want = oracle()
    src = put(want, mesh((2, 2), ("fsdp", "tensor")), {"w": P("fsdp", "tensor"), "b": P("tensor"),
                                                     "s": P()})
    units = host_units(src)
    # leaves in flatten order b, s, w: b split in 2 (replicated over fsdp: once), s once,
    # w in 4 blocks
    assert sorted(units) == ["00000:0-3", "00000:3-6", "00001:",
                             "00002:0-4_0-3", "00002:0-4_3-6", "00002:4-8_0-3", "00002:4-8_3-6"]
    dst_mesh = mesh((4,), ("tensor",))
    target = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype,
                                      sharding=NamedSharding(dst_mesh, P()))
              for k, v in want.items()}
    target["w"] = jax.ShapeDtypeStruct((8, 6), np.float32,
                                       sharding=NamedSharding(dst_mesh, P("tensor", None)))
    # split the units between two "hosts" as a multi-host learner would
    keys = sorted(units)
    got = assemble([{k: units[k] for k in keys[::2]}, {k: units[k] for k in keys[1::2]}],
                   target)
    for k, v in want.items():
        assert got[k].sharding == target[k].sharding
        np.testing.assert_array_equal(np.asarray(got[k]), v)
    assert np.signbit(np.asarray(got["s"]))                     # bits, not values


def test_missing_overlapping_and_foreign_shards_are_named():
    src = put(oracle(), mesh((2,), ("fsdp",)), {"w": P("fsdp"), "b": P(), "s": P()})
    units = host_units(src)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          src)
    missing = {k: v for k, v in units.items() if k != "00002:4-8_0-6"}
    with pytest.raises(LayoutError, match=r"\['w'\]: 24 elements in no learner host's shards "
                                          r"\(first at index \(4, 0\)\)"):
        assemble([missing], target)
    with pytest.raises(LayoutError, match="learner host 1: shard 00002:0-4_0-6 of \\['w'\\] "
                                          "overlaps"):
        assemble([units, {"00002:0-4_0-6": units["00002:0-4_0-6"]}], target)
    with pytest.raises(LayoutError, match="shard 00002:0-9_0-6 lies outside"):
        assemble([{"00002:0-9_0-6": np.zeros((9, 6), np.float32)}], target)
    with pytest.raises(LayoutError, match="is float64\\[4, 6\\], expected float32\\[4, 6\\]"):
        assemble([{"00002:0-4_0-6": np.zeros((4, 6))}], target)
    with pytest.raises(LayoutError, match="not a host-shard unit key"):
        parse_unit_key("w")
    assert parse_unit_key("['" + unit_key(3, [(0, 2), (4, 8)]) + "']") == (3, ((0, 2), (4, 8)))


class FakeSubscriber:
    """Offers (version, unit) pairs from a script, like WeightSubscriber.poll."""

    def __init__(self, script):
        self.script = list(script)

    def poll(self):
        return self.script.pop(0) if self.script else None

    def close(self):
        pass


def test_puller_waits_until_every_host_offers_the_same_version():
    src = put(oracle(), mesh((2,), ("fsdp",)), {"w": P("fsdp"), "b": P(), "s": P()})
    units = host_units(src)
    keys = sorted(units)
    u0, u1 = {k: units[k] for k in keys[:3]}, {k: units[k] for k in keys[3:]}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          src)
    puller = HostShardPuller([FakeSubscriber([(1, u0), None]),
                              FakeSubscriber([None, (1, u1)])], target)
    assert puller.poll() is None                       # host 1 has not published version 1
    version, params = puller.poll()
    assert version == puller.version == 1
    np.testing.assert_array_equal(np.asarray(params["w"]), oracle()["w"])
    assert puller.poll() is None                       # nothing newer


@pytest.mark.slow
def test_sampler_pulls_from_two_learner_hosts(tmp_path):
    """2 learner processes x 2 devices (fsdp=2 x tensor=2, after one step) each serve their
    own shards; this process (the sampler, tensor=4 on its 4 devices) pulls from both and
    its parameters equal the learner's bitwise."""
    from flax import nnx

    from rlflow.config import MeshConfig
    from rlflow.exchange.transfer import WeightSubscriber
    from rlflow.mesh import make_mesh
    from rlflow.models.hf import build_model
    from rlflow.learner.local_hosts import start_processes, wait_processes
    import mp_jobs

    procs = start_processes("mp_jobs:serve_host_shards", num_processes=2,
                            devices_per_process=2, work_dir=tmp_path, extra_paths=[TESTS])
    try:
        addrs = []
        for i in range(2):
            path = tmp_path / f"coordinator_{i}.txt"
            deadline = time.monotonic() + 900
            while not path.exists():
                assert time.monotonic() < deadline, "learner host did not publish"
                assert all(p.poll() in (None, 0) for p in procs), [p.poll() for p in procs]
                time.sleep(0.5)
            addrs.append(path.read_text())
        model, _ = build_model(mp_jobs.MODEL, mesh=make_mesh(MeshConfig(tensor=4)))
        target = nnx.split(model, nnx.Param)[1]
        puller = HostShardPuller([WeightSubscriber(a, consumer_id="sampler-0", timeout_s=300)
                                  for a in addrs], target)
        got = None
        deadline = time.monotonic() + 300
        while got is None and time.monotonic() < deadline:
            got = puller.poll()
        puller.close()
    finally:
        (tmp_path / "done").write_text("")
    results = wait_processes(procs, tmp_path, timeout_s=300)
    version, params = got
    assert version == results[0]["version"] == 1
    assert results[0]["units"] and not set(results[0]["units"]) & set(results[1]["units"])
    want = results[0]["params"]
    flat = {k: v[...] for k, v in nnx.to_flat_state(params)}
    assert set(flat) == set(want)
    for k, w in want.items():
        assert flat[k].sharding.mesh.shape["tensor"] == 4
        np.testing.assert_array_equal(np.asarray(flat[k]), w, err_msg=str(k))
