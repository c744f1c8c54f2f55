"""Weights out of a multi-host learner: per-host transfer units, assembled by a sampler."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rlflow.exchange.host_shards import (HostShardPuller, assemble, host_units,
                                         parse_unit_key, unit_key)
from rlflow.exchange.layout import LayoutError
from mp_jobs import SHARED_RUN_TIMEOUT_S


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
@pytest.mark.timeout(SHARED_RUN_TIMEOUT_S)   # the first test pays the shared 2-host run
def test_sampler_pulls_from_two_learner_hosts(two_learner_hosts):
    """2 learner processes x 2 devices (fsdp=2 x tensor=2, after 3 steps) each serve their
    own shards; this process (the sampler, tensor=4 on its 4 devices) pulled from both
    (tests/conftest.py) and its parameters equal the learner's bitwise."""
    results = two_learner_hosts["results"]
    assert two_learner_hosts["pulled_version"] == results[0]["version"] == 3
    assert results[0]["units"] and not set(results[0]["units"]) & set(results[1]["units"])
    want, got = results[0]["params"], two_learner_hosts["pulled"]
    assert set(got) == set(want)
    for k, w in want.items():
        assert got[k].sharding.mesh.shape["tensor"] == 4
        np.testing.assert_array_equal(np.asarray(got[k]), w, err_msg=str(k))
