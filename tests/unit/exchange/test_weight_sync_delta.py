"""Delta weight sync (runtime.weight_sync="delta", rlflow.exchange.delta): the codec against a
numpy XOR oracle, and real pulls (jax.experimental.transfer, publisher and subscribers in
this process on the 4 fake CPU devices) of versions made by real optimizer steps: the
replica's weights stay bitwise equal to the learner's through deltas, a missed version, a
corrupted delta, LoRA adapters, a relay tree and a multi-host learner's per-host shards."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import xxhash
import zstandard
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rlflow.config import ModelConfig
from rlflow.exchange import delta
from rlflow.exchange.coordinator import Coordinator
from rlflow.exchange.host_shards import HostShardPuller, host_units
from rlflow.exchange.relay import RelayOffers
from rlflow.exchange.transfer import WeightPublisher, WeightSubscriber
from rlflow.models import build_model
from rlflow.models.logprobs import token_logprobs
from rlflow.models.lora import LoraSpec, tree_bytes
from rlflow.models.lora_decoder import lora_model_parts

VOCAB = 64


def bits_equal(a, b) -> bool:
    """Bitwise equality of two arrays (the oracle: raw bytes, dtype and shape)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_trees_bitwise_equal(got, want):
    gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(gl) == len(wl)
    for i, (g, w) in enumerate(zip(gl, wl)):
        assert bits_equal(g, w), f"leaf {i} differs"


# ----------------------------------------------------------------- the codec


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_codec_round_trip_is_bitwise_and_the_payload_is_the_xor(dtype):
    rng = np.random.default_rng(0)
    prev = rng.standard_normal((33, 7)).astype(dtype)
    new = (prev.astype(np.float32) + 1e-3 * rng.standard_normal(prev.shape)).astype(dtype)
    new.flat[:4] = np.array([np.nan, -0.0, np.inf, 0.0], np.float32).astype(dtype)
    payload = delta.encode(prev, new)
    assert bits_equal(delta.decode(prev, payload), new)
    # numpy oracle: the decompressed bytes are the XOR's byte planes
    u = np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")
    xor = prev.view(u).reshape(-1) ^ new.view(u).reshape(-1)
    planes = np.frombuffer(zstandard.ZstdDecompressor().decompress(payload), np.uint8)
    assert bits_equal(planes, xor.view(np.uint8).reshape(-1, u.itemsize).T.reshape(-1))
    assert bits_equal(delta.decode(new, delta.encode(new, new)), new)   # no change
    assert delta.checksum(new) == xxhash.xxh3_64_intdigest(new.tobytes())
    with pytest.raises(ValueError, match="one shape and dtype"):
        delta.encode(prev, new[:3])
    with pytest.raises(ValueError, match="itemsize 16"):
        delta.bit_view(np.zeros(2, np.complex128))


def test_decoder_rejects_a_wrong_base_a_corrupt_frame_and_a_hash_mismatch():
    rng = np.random.default_rng(1)
    v0 = [rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal(5)
          .astype(np.float32)]
    v1 = [x + np.float32(0.5) for x in v0]
    enc = delta.DeltaEncoder(full_every=10)
    assert enc.update(0, v0) is None                     # the first version goes whole
    d = enc.update(1, v1)
    assert (d.version, d.base) == (1, 0)
    assert d.checksums == [delta.checksum(x) for x in v1]
    dec = delta.DeltaDecoder()
    with pytest.raises(delta.DeltaError, match="needs version 0; this subscriber holds -1"):
        dec.apply(1, 0, d.payloads, d.checksums)
    dec.hold(0, v0)
    bad = bytearray(d.payloads[0])
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(delta.DeltaError, match="w, delta 0 -> 1"):
        dec.apply(1, 0, [bytes(bad), d.payloads[1]], d.checksums, ["w", "b"])
    # a valid frame against the wrong tensor: only the hash can tell
    wrong = delta.encode(v0[1], v1[1] + np.float32(1.0))
    with pytest.raises(delta.DeltaError, match="xxh3-64 .* is not the learner's"):
        dec.apply(1, 0, [d.payloads[0], wrong], d.checksums, ["w", "b"])
    assert dec.version == 0                               # the held version is kept
    got = dec.apply(1, 0, d.payloads, d.checksums)
    assert all(bits_equal(g, w) for g, w in zip(got, v1)) and dec.version == 1


def test_encoder_sends_every_nth_version_whole():
    enc = delta.DeltaEncoder(full_every=3)
    x = np.zeros(4, np.float32)
    got = [enc.update(v, [x + v]) is None for v in range(7)]
    assert got == [True, False, False, True, False, False, True]
    assert enc.update(7, [np.zeros(5, np.float32)]) is None   # a new shape goes whole
    with pytest.raises(ValueError, match="delta_full_every must be >= 1"):
        delta.DeltaEncoder(full_every=0)


def test_config_names_the_field_of_a_bad_delta_setting():
    from rlflow.config import RuntimeConfig
    from rlflow.config.validation import ConfigError

    assert RuntimeConfig().weight_sync == "full"
    with pytest.raises(ConfigError, match=r"^runtime\.weight_sync: 'delta' needs "
                                          r"runtime\.weight_transfer='transfer'"):
        RuntimeConfig(weight_sync="delta", weight_transfer="orbax")
    with pytest.raises(ConfigError, match=r"^runtime\.delta_full_every"):
        RuntimeConfig(weight_sync="delta", delta_full_every=0)
    with pytest.raises(ConfigError, match=r"^runtime\.delta_full_every: only applies with "
                                          r"runtime\.weight_sync='delta'.* 5 would be ignored"):
        RuntimeConfig(delta_full_every=5)                  # a full sync, which never codes deltas
    assert RuntimeConfig(weight_sync="delta", delta_full_every=5).delta_full_every == 5
    with pytest.raises(ConfigError, match=r"^runtime\.weight_sync"):
        RuntimeConfig(weight_sync="xor")


# ----------------------------------------------------------------- real optimizer versions


@pytest.fixture(scope="module")
def tiny_decoder():
    return build_model(ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_layers=1, head_dim=8, init_seed=3))


def adam_versions(trained, loss, steps: int, lr: float):
    """``[(version, tree)]``: ``trained`` (version 0) and after each of ``steps`` Adam steps
    on ``loss(tree) -> scalar``."""
    opt = optax.adam(lr)

    @jax.jit
    def step(p, s):
        u, s = opt.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, u), s

    out, state = [(0, trained)], opt.init(trained)
    for v in range(1, steps + 1):
        trained, state = step(trained, state)
        out.append((v, trained))
    return out


def decoder_versions(model, steps: int, lr: float = 1e-3):
    """The parameters of a tiny decoder after each of ``steps`` Adam steps of next-token
    loss on two random rows of 12 tokens."""
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 12)), jnp.int32)
    positions = jnp.arange(12)[None].repeat(2, 0)

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens, positions, jnp.ones(tokens.shape, bool))
        return -token_logprobs(logits[:, :-1], tokens[:, 1:]).mean()
    return adam_versions(params, loss, steps, lr)


def on_mesh(tree):
    """``tree`` with its 2-D leaves sharded over the 4 fake devices (rows), others on one."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))

    def put(x):
        ok = x.ndim >= 2 and x.shape[0] % 4 == 0
        return jax.device_put(x, NamedSharding(mesh, P("fsdp")) if ok else jax.devices()[0])
    return jax.tree.map(put, tree)


@pytest.fixture(scope="module")
def versions(tiny_decoder):
    return [(v, on_mesh(t)) for v, t in decoder_versions(tiny_decoder[0], 20)]


@pytest.fixture
def served():
    """``serve(publisher_or_offers) -> coordinator``, closed after the test."""
    made = []

    def serve(source):
        made.append(Coordinator(source).start())
        return made[-1]
    yield serve
    for c in made:
        c.close()


def offer_counts(pub) -> dict:
    """``pub.sync`` less ``pending_answers`` (how many asks came while a delta was being
    made on the publisher's thread depends on the scheduling)."""
    return {k: v for k, v in pub.sync.items() if k != "pending_answers"}


def _subscriber(coord, name, target=None, **kw):
    return WeightSubscriber(coord.address, consumer_id=name, target=target, timeout_s=30,
                            weight_sync="delta", **kw)


def test_twenty_steps_of_deltas_stay_bitwise_equal_and_a_missed_version_pulls_whole(
        versions, served):
    pub = WeightPublisher(pull_timeout_s=30, weight_sync="delta", delta_full_every=8)
    coord = served(pub)
    target = versions[0][1]
    sub = _subscriber(coord, "s0", target=target)
    missed = {13, 14}
    for v, params in versions:
        pub.publish(v, params)
        if v in missed:
            continue
        got = sub.poll()
        assert got is not None and got[0] == v
        assert_trees_bitwise_equal(got[1], params)
    # versions 0, 8 and 16 go whole; 15 too (the replica holds 12, missed 13 and 14)
    assert sub.metrics["full_pulls"] == 4 and sub.metrics["delta_pulls"] == 15
    assert offer_counts(pub) == {"delta_offers": 15, "full_offers": 4, "full_fallbacks": 1}
    assert 0 < pub.delta_nbytes < pub.nbytes
    assert sub.metrics["delta_rejected"] == 0


class CorruptsInTransit(WeightSubscriber):
    """Flips one byte of the first delta it receives (as a bad link or relay would)."""

    flipped = False

    def _apply_delta(self, offer, arrays):
        if not self.flipped:
            self.flipped = True
            bad = np.asarray(arrays[0]).copy()
            bad[len(bad) // 2] ^= 0x5A
            arrays = [jax.device_put(bad, arrays[0].sharding), *arrays[1:]]
        return super()._apply_delta(offer, arrays)


def test_a_corrupted_delta_is_rejected_and_replaced_by_a_full_pull(versions, served):
    pub = WeightPublisher(pull_timeout_s=30, weight_sync="delta", delta_full_every=100)
    coord = served(pub)
    sub = CorruptsInTransit(coord.address, consumer_id="s0", target=versions[0][1],
                            timeout_s=30, weight_sync="delta")
    for v, params in versions[:4]:
        pub.publish(v, params)
        got = sub.poll()
        assert got[0] == v
        assert_trees_bitwise_equal(got[1], params)
    assert sub.flipped and sub.metrics["delta_rejected"] == 1
    assert (sub.metrics["full_pulls"], sub.metrics["delta_pulls"]) == (2, 2)
    assert pub.sync["full_fallbacks"] == 1


def test_lora_adapter_deltas_stay_bitwise_equal(tiny_decoder, served):
    """The learner's adapter tree (``lora_model_parts``), moved by Adam on a quadratic loss
    (a forward pass adds nothing here: only the published tree matters)."""
    _, adapters, _ = lora_model_parts(*tiny_decoder, LoraSpec(rank=2, alpha=4.0))
    adapters = adam_versions(adapters, lambda t: sum(
        jnp.sum((x - 0.3) ** 2) for x in jax.tree.leaves(t)), 6, 1e-2)
    pub = WeightPublisher(pull_timeout_s=30, weight_sync="delta")
    coord = served(pub)
    sub = _subscriber(coord, "s0", target=adapters[0][1])
    for v, tree in adapters:
        pub.publish(v, tree)
        got = sub.poll()
        assert_trees_bitwise_equal(got[1], tree)
    assert pub.nbytes == tree_bytes(adapters[-1][1])     # the adapters alone move
    assert sub.metrics["delta_pulls"] == 6


def test_a_relay_tree_forwards_deltas_and_the_learner_serves_a_replica_that_missed_one(
        versions, served):
    """Three replicas, fan-out 1: the learner serves r0, r0 relays to r1, r1 to r2; each
    relay serves the delta bytes it pulled. r2 misses a version and gets the whole next one
    from the learner at once. The versions are rounded to bf16 (a bf16 sampler's weights)."""
    pub = WeightPublisher(pull_timeout_s=30, weight_sync="delta", layout="single_device")
    offers = RelayOffers(pub, fanout=1, assign_timeout_s=30, num_consumers=3)
    coord = served(offers)
    subs = [_subscriber(coord, f"r{i}", relay_fanout=1, relay_timeout_s=30) for i in range(3)]
    for v, params in versions[:5]:
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        pub.publish(v, params)
        for i, sub in enumerate(subs):
            if v == 3 and i == 2:
                continue                                   # r2 misses version 3
            got = sub.poll()
            assert got is not None and got[0] == v
            assert_trees_bitwise_equal(list(got[1].values()), params)
    sources = offers.bytes_sent
    assert sources["r0"] > 0 and sources["r1"] > 0       # relays served (deltas) too
    assert [s.metrics["delta_pulls"] for s in subs] == [4, 4, 2]
    assert subs[2].metrics["full_pulls"] == 2 and pub.sync["full_fallbacks"] == 1
    # the learner sent one delta per version, plus the whole version 4 to r2
    assert offers.learner_bytes_by_version[4] == pub.delta_nbytes + pub.nbytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_learner_host_deltas_its_own_shards(versions, served, dtype):
    """A 2-host learner's per-host shards (the host units split between two publishers,
    each with its own coordinator) through a HostShardPuller of delta subscribers; with a
    bf16 sampler each host's units are of the learner's bf16 cast (LearnerHosts.publish)."""
    from rlflow.learner.publish import published_params
    from rlflow.sampler.precision import pull_target

    pubs = [WeightPublisher(pull_timeout_s=30, weight_sync="delta") for _ in range(2)]
    coords = [served(p) for p in pubs]
    target = pull_target(versions[0][1], dtype)
    puller = HostShardPuller([_subscriber(c, "s0") for c in coords], target)
    for v, params in versions[:4]:
        sent = published_params(params, dtype)
        units = sorted(host_units(sent).items())
        for h, pub in enumerate(pubs):
            pub.publish(v, dict(units[h::2]))
        got = puller.poll()
        assert got is not None and got[0] == v
        want = jax.tree.leaves(params) if dtype == "float32" else bf16_oracle(params)
        assert all(bits_equal(g, w) for g, w in zip(jax.tree.leaves(got[1]), want))
    assert [s.metrics["delta_pulls"] for s in puller.subscribers] == [3, 3]


def test_a_full_subscriber_beside_a_delta_learner_still_gets_every_version_whole(
        versions, served):
    pub = WeightPublisher(pull_timeout_s=30, weight_sync="delta")
    coord = served(pub)
    sub = WeightSubscriber(coord.address, consumer_id="s0", target=versions[0][1],
                           timeout_s=30)                  # weight_sync="full"
    for v, params in versions[:3]:
        pub.publish(v, params)
        assert_trees_bitwise_equal(sub.poll()[1], params)
    # it holds no base, so it asks whole versions: never offered a delta
    assert (sub.metrics["full_pulls"], sub.metrics["delta_rejected"]) == (3, 0)
    assert offer_counts(pub) == {"delta_offers": 0, "full_offers": 3, "full_fallbacks": 2}


def test_relay_offers_pass_full_on_only_to_a_source_that_takes_it():
    class OldSource:                      # an offer source from before delta sync
        version, nbytes, layout_desc = 0, 100, {"leaves": []}

        def offer(self, consumer, have_version):
            return {"version": 0, "address": "learner:1", "uuid": 7, "transports": 1,
                    "layout": self.layout_desc}

    relay = RelayOffers(OldSource(), fanout=2)
    got = relay.offer("a", -1, full=True)
    assert (got["source"], got["uuid"]) == ("learner", 7)
    assert relay.bytes_sent == {"learner": 100}


# ----------------------------------------------------------------- a bf16 sampler


def bf16_oracle(tree) -> list:
    """numpy's float32 -> bfloat16 rounding (ml_dtypes, round to nearest even) of each leaf."""
    return [np.asarray(x).astype(ml_dtypes.bfloat16) for x in jax.tree.leaves(tree)]


def test_a_bf16_sampler_holds_the_learners_bf16_cast_bitwise_through_20_steps(
        versions, served):
    """The learner's own Publisher with ``sampler.dtype="bfloat16"``: each float32 version
    is published cast to bf16 (half the bytes), and a delta subscriber that misses versions
    13-14 and receives one corrupted delta still holds, after every pull, exactly numpy's
    bf16 rounding of the learner's float32 weights."""
    from rlflow.config import ExperimentConfig, RuntimeConfig, SamplerConfig
    from rlflow.learner.publish import Publisher, keeps_params
    from rlflow.sampler.precision import pull_target

    cfg = ExperimentConfig(sampler=SamplerConfig(dtype="bfloat16"),
                           runtime=RuntimeConfig(weight_sync="delta", delta_full_every=8,
                                                 transfer_timeout_s=30))
    assert cfg.published_dtype == "bfloat16" and not keeps_params(cfg)
    pub = Publisher(cfg, "127.0.0.1", params_kept=keeps_params(cfg))
    coord = served(pub.offers)
    target = pull_target(versions[0][1], cfg.published_dtype)   # bf16, the learner's mesh
    sub = CorruptsInTransit(coord.address, consumer_id="s0", target=target, timeout_s=30,
                            weight_sync="delta")
    try:
        for v, params in versions:
            pub.publish(v, params)
            if v in (13, 14):
                continue
            got = sub.poll()
            assert got is not None and got[0] == v
            for i, (g, w, t) in enumerate(zip(jax.tree.leaves(got[1]), bf16_oracle(params),
                                              jax.tree.leaves(target))):
                assert bits_equal(g, w), f"version {v}, leaf {i}"
                assert g.sharding == t.sharding
    finally:
        pub.close()
    f32_bytes = tree_bytes(versions[-1][1])
    assert pub.bytes == pub.impl.nbytes == f32_bytes // 2
    # whole: 0, 8, 16 (keyframes), 1 (its delta was corrupted), 15 (after missing 13-14)
    assert sub.flipped and sub.metrics["delta_rejected"] == 1
    assert (sub.metrics["full_pulls"], sub.metrics["delta_pulls"]) == (5, 14)
    assert 0 < pub.impl.delta_nbytes < pub.impl.nbytes


def test_published_params_cast_model_leaves_keep_adapters_and_never_alias(tiny_decoder):
    from rlflow.learner.publish import published_params

    _, adapters, _ = lora_model_parts(*tiny_decoder, LoraSpec(rank=2, alpha=4.0,
                                                              train_embeddings=True))
    tree = on_mesh(adapters)
    out = published_params(tree, "bfloat16")
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(out)[0]]
    assert any("_lora" in p for p in paths) and any("embed" in p for p in paths)
    for p, x, y in zip(paths, jax.tree.leaves(tree), jax.tree.leaves(out)):
        want = np.asarray(x) if "_lora" in p else np.asarray(x).astype(ml_dtypes.bfloat16)
        assert bits_equal(y, want), p
        assert y.sharding == x.sharding, p
    # fresh buffers: the learner's next step may donate (here: delete) the originals
    for x in jax.tree.leaves(tree):
        x.delete()
    assert all(np.isfinite(np.asarray(y, np.float32)).all() for y in jax.tree.leaves(out))


def test_the_delta_is_made_off_the_publishing_thread_in_order(versions, served, monkeypatch):
    """``publish`` returns while the delta is still being made (the encoder is held on an
    event here): a subscriber holding the base is answered "pending" and gets the delta once
    it is made, one that needs the whole version gets it at once. Of the versions published
    while the worker is busy only the newest is coded, against the version in hand (2 is
    replaced by 3 before it starts: 3's delta is from 1)."""
    import threading

    monkeypatch.setattr(delta, "PARALLEL_MIN_BYTES", 0)    # the codec's threads too
    pub = WeightPublisher(pull_timeout_s=30, weight_sync="delta")
    gate, entered = threading.Event(), threading.Event()
    encoder = pub._deltas._encoder
    update = encoder.update
    coded = []

    def held(version, leaves):
        coded.append(version)
        entered.set()
        assert gate.wait(30)
        return update(version, leaves)
    try:
        pub.publish(0, versions[0][1])
        assert pub.wait_delta(30)
        encoder.update = held
        pub.publish(1, versions[1][1])             # returns with the encoder held
        assert entered.wait(30)
        assert pub.offer("holds-0", 0) == {"version": 1, "pending": True}
        whole = pub.offer("new", -1)
        assert "uuid" in whole and "delta" not in whole and whole["nbytes"] == pub.nbytes
        pub.publish(2, versions[2][1])             # waits behind version 1 ...
        assert pub.offer("holds-1", 1) == {"version": 2, "pending": True}
        pub.publish(3, versions[3][1])             # ... and is replaced by 3
        assert pub.offer("holds-1", 1) == {"version": 3, "pending": True}
        gate.set()
        assert pub.wait_delta(30)
        assert coded == [1, 3]
        assert "delta" not in pub.offer("holds-0", 0) and "delta" not in pub.offer("h2", 2)
        got = pub.offer("holds-1", 1)
        assert got["version"] == 3 and got["delta"]["base"] == 1
        # version 3's delta was made against version 1: it rebuilds version 3 from 1
        dec = delta.DeltaDecoder()
        dec.hold(1, [np.asarray(x) for x in jax.tree.leaves(versions[1][1])])
        d = pub._deltas.ready(3, 1)[0]
        out = dec.apply(3, 1, d.payloads, d.checksums)
        assert all(bits_equal(a, b) for a, b in zip(out, jax.tree.leaves(versions[3][1])))
        assert pub.sync["pending_answers"] == 3
    finally:
        gate.set()
        pub.close()
    # no delta thread outlives close(): a finished learner exits without joining one
    # (rlflow.launcher.learner_hosts.leave_background_compiles counts the threads left)
    own = (pub._deltas.thread_name, "rlflow-delta_")      # its thread, the codec's threads
    assert not [t.name for t in threading.enumerate() if t.name.startswith(own)]
