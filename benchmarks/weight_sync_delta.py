"""Delta weight sync against full versions (``runtime.weight_sync``), on real optimizer steps.

Versions: the GSM8K headline model (``benchmarks/_gsm8k_model.py``, Qwen2 4.46M parameters,
float32) trained here for ``--steps`` (20) steps of next-token loss on GSM8K questions
(4 rows of 128 tokens, the BPE tokenizer trained on GSM8K) with the learner's optimizer
(``rlflow.learner.optimizer.make_optimizer``) at the learning rate, warm-up and clipping of
``configs/gsm8k.py`` (AdamW, lr 1e-6, 10 warm-up steps, clip 1.0). ``configs/gsm8k.py`` runs its sampler in
bfloat16, so its learner publishes each version rounded to bf16 (``ExperimentConfig.
published_dtype``, cast by the learner's own ``rlflow.learner.publish.published_params``).

1. **Bytes per version** (every version after the first; ``rlflow.exchange.delta``):

       RESULT delta_bytes_over_full_gsm8k_config <x> x   the headline: lr AND published
           dtype of configs/gsm8k.py as shipped (bf16), over a full version of that dtype
       RESULT delta_bytes_over_full <x> x          float32 versions (a float32 sampler)
       RESULT delta_bytes_over_full_bfloat16 <x> x
       RESULT delta_encode_mb_per_s_<dtype> / delta_decode_mb_per_s_<dtype>   (one core,
           the fastest version: XOR, byte planes, zstd and the hash of the model's bytes)

2. **Publish -> all-swapped** through the relay tree (fan-out 2), full vs delta, for 1, 2
   and 4 replica processes (1 CPU device each; this process is the learner, as in
   ``benchmarks/sampler_replicas.py``): the median over the versions after the first
   (the first goes whole in both modes), and the bytes every source sent per version over
   one full version per replica:

       RESULT replicas_<n>_<dtype>_<full|delta>_all_swapped_s <s> s
       RESULT replicas_<n>_<dtype>_wire_bytes_delta_over_full <x> x
       RESULT replicas_<n>_<dtype>_all_swapped_delta_over_full <x> x
       RESULT replicas_<n>_<dtype>_<full|delta>_publish_call_ms <ms> ms   median time of
           ``WeightPublisher.publish`` on the caller's (the learner's) thread
       RESULT replicas_<n>_<dtype>_delta_encode_ms <ms> ms   median time the background
           thread spent making a version's delta (rlflow.exchange.delta_worker): what
           ``publish`` took on the learner's thread before it moved there

   On one 2-core host every process shares the cores and the link is loopback, so the
   time saved by moving fewer bytes is traded against the host codec's CPU time; the
   link-bound case is the model below.

3. **The fan-out model with deltas** (7B bf16 = 14 GB, 64 replicas, ``--link-gbps`` per
   host link, fan-out 2, store and forward per hop; a relay forwards a delta's bytes before
   decoding them, as the subscriber does): full ``L (a + 2B / link)``; delta
   ``B / (c enc) + L (a + 2 r B / link) + B / (c dec)`` with ``r`` the bf16 ratio of part
   1, ``enc``/``dec`` the one-core codec rates measured here, ``c`` the cores the codec
   runs on (``--codec-cores``, 16: the leaves are coded on a thread per core; the
   ``_1core`` line has c = 1) and ``a`` the per-hop overhead (the median 1-replica full
   publish -> swap of the GSM8K model measured here, an upper bound):

       RESULT model_7b_bf16_64_replicas_relay_full_s <s> s
       RESULT model_7b_bf16_64_replicas_relay_delta_s / _relay_delta_1core_s <s> s
       RESULT model_7b_bf16_64_replicas_delta_over_full <x> x

Usage: ``python benchmarks/weight_sync_delta.py [--steps 20] [--replicas 1,2,4]
[--dtypes float32,bfloat16] [--link-gbps 100]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=1").strip()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _peers import run_replica, stop_peers  # noqa: E402


def train_versions(steps: int) -> list:
    """``[params]`` (numpy leaves, flatten order) of the GSM8K model: the initial version,
    then one per step of the learner's optimizer at configs/gsm8k.py's learning rate."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import _gsm8k_model as g
    from configs.gsm8k import config as gsm8k_config
    from rlflow.learner.optimizer import make_optimizer
    from rlflow.models import build_model
    from rlflow.models.logprobs import token_logprobs

    with tempfile.TemporaryDirectory() as tmp:
        tok = g.build_tokenizer(tmp)
        rows = np.asarray(g.gsm8k_prompts(tok, 4, 128), np.int32)
    model, _ = build_model(g.model_config())
    graphdef, params = nnx.split(model, nnx.Param)
    opt, _ = make_optimizer(gsm8k_config().learner)
    tokens = jnp.asarray(rows)
    positions = jnp.arange(tokens.shape[1])[None].repeat(tokens.shape[0], 0)

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens, positions, jnp.ones(tokens.shape, bool))
        return -token_logprobs(logits[:, :-1], tokens[:, 1:]).mean()

    @jax.jit
    def step(p, s):
        u, s = opt.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, u), s

    state = opt.init(params)
    out = [[np.array(x) for x in jax.tree.leaves(params)]]
    for _ in range(steps):
        params, state = step(params, state)
        out.append([np.array(x) for x in jax.tree.leaves(params)])
    return out


def published(versions: list, cfg) -> list:
    """``versions`` as the learner of ``cfg`` publishes them: in ``cfg.published_dtype``,
    cast on the device by ``rlflow.learner.publish.published_params``."""
    import jax
    import numpy as np

    from rlflow.learner.publish import published_params

    return [[np.array(x) for x in published_params([jax.device_put(x) for x in leaves],
                                                   cfg.published_dtype)]
            for leaves in versions]


def as_dtype(versions: list, dtype: str) -> list:
    import ml_dtypes
    import numpy as np

    if dtype == "float32":
        return versions
    want = np.dtype(getattr(ml_dtypes, dtype))
    return [[x.astype(want) for x in leaves] for leaves in versions]


def codec_figures(versions: list) -> tuple[float, float, float]:
    """(median delta bytes over full bytes, encode MB/s, decode MB/s) over the versions
    after the first; the rates from the fastest version (load from other processes only
    slows a version down; one core: zstd's single-threaded compressor)."""
    from rlflow.exchange import delta

    ratios, enc_t, dec_t = [], [], []
    full = sum(x.nbytes for x in versions[0])
    for prev, new in zip(versions, versions[1:]):
        t0 = time.perf_counter()
        payloads = [delta.encode(a, b) for a, b in zip(prev, new)]
        [delta.checksum(b) for b in new]
        t1 = time.perf_counter()
        for a, p in zip(prev, payloads):
            delta.checksum(delta.decode(a, p))
        enc_t.append(t1 - t0)
        dec_t.append(time.perf_counter() - t1)
        ratios.append(sum(len(p) for p in payloads) / full)
    return statistics.median(ratios), full / min(enc_t) / 1e6, full / min(dec_t) / 1e6


def measure(n: int, versions: list, sync: str) -> tuple[float, float, float, float]:
    """(median publish -> all-swapped s over the versions after the first, bytes sent by
    every source per such version, median ms of the ``publish`` call, median ms of the
    background delta encode (0 for full))."""
    import jax

    from rlflow.exchange.coordinator import Coordinator
    from rlflow.exchange.relay import RelayOffers
    from rlflow.exchange.transfer import WeightPublisher

    pub = WeightPublisher(pull_timeout_s=120, layout="single_device", donated=False,
                          weight_sync=sync, delta_full_every=10**6)
    offers = RelayOffers(pub, fanout=2, assign_timeout_s=120, num_consumers=n)
    coord = Coordinator(offers).start()
    env = dict(os.environ, PYTHONPATH=REPO)
    peers = [subprocess.Popen([sys.executable, __file__, "replica", f"r{i}", coord.address,
                               sync], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for i in range(n)]
    times, calls, encodes, sent_before = [], [], [], 0
    try:
        for v, leaves in enumerate(versions):
            tree = {f"{i:03d}": jax.device_put(x) for i, x in enumerate(leaves)}
            jax.block_until_ready(tree)
            if v == 1:
                sent_before = sum(offers.bytes_sent.values())
            t0 = time.time()
            pub.publish(v, tree)
            call_ms = (time.time() - t0) * 1e3
            for p in peers:
                p.stdin.write("pull\n")
                p.stdin.flush()
            done = [p.stdout.readline().split() for p in peers]
            if v >= 1:
                times.append(max(float(d[1]) for d in done) - t0)
                calls.append(call_ms)
                pub.wait_delta()
                encodes.append(pub.delta_encode_s * 1e3)
        if sync == "delta":
            assert all(int(d[2]) == len(versions) - 1 for d in done), done
        sent = (sum(offers.bytes_sent.values()) - sent_before) / (len(versions) - 1)
    finally:
        stop_peers(peers, 60)
        coord.close()
        pub.close()
    return (statistics.median(times), sent, statistics.median(calls),
            statistics.median(encodes))


def main() -> None:
    from sampler_replicas import tree_levels

    from configs.gsm8k import config as gsm8k_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--replicas", default="1,2,4")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--link-gbps", type=float, default=100.0)
    ap.add_argument("--codec-cores", type=int, default=16)
    args = ap.parse_args()
    t0 = time.time()
    base = train_versions(args.steps)
    full_mb = sum(x.nbytes for x in base[0]) / 2**20
    print(f"# {args.steps} optimizer steps of the GSM8K model ({full_mb:.1f} MB float32) in "
          f"{time.time() - t0:.0f} s", flush=True)
    gsm8k = gsm8k_config()
    ratio, _, _ = codec_figures(published(base, gsm8k))
    print(f"RESULT delta_bytes_over_full_gsm8k_config {ratio:.4f} x median over {args.steps} "
          f"versions, configs/gsm8k.py as shipped: lr {gsm8k.learner.lr:g} AdamW, published "
          f"in {gsm8k.published_dtype} (sampler.dtype {gsm8k.sampler.dtype}), target <= 0.10",
          flush=True)
    codec = {}
    for dtype in args.dtypes.split(","):
        ratio, enc, dec = codec_figures(as_dtype(base, dtype))
        codec[dtype] = (ratio, enc, dec)
        name = "delta_bytes_over_full" + ("" if dtype == "float32" else f"_{dtype}")
        print(f"RESULT {name} {ratio:.4f} x median over {args.steps} versions, {dtype} "
              f"(target <= 0.10), lr 1e-6 AdamW as configs/gsm8k.py", flush=True)
        print(f"RESULT delta_encode_mb_per_s_{dtype} {enc:.0f} MB/s one core, XOR + byte "
              f"planes + zstd + xxh3 of the model's bytes", flush=True)
        print(f"RESULT delta_decode_mb_per_s_{dtype} {dec:.0f} MB/s one core", flush=True)
    hop = None
    for dtype in args.dtypes.split(","):
        versions = as_dtype(base, dtype)
        full_bytes = sum(x.nbytes for x in versions[0])
        for n in [int(x) for x in args.replicas.split(",")]:
            got = {sync: measure(n, versions, sync) for sync in ("full", "delta")}
            for sync, (t, _, call, _) in got.items():
                print(f"RESULT replicas_{n}_{dtype}_{sync}_all_swapped_s {t:.3f} s median "
                      f"publish -> all swapped, relay fan-out 2, loopback", flush=True)
                print(f"RESULT replicas_{n}_{dtype}_{sync}_publish_call_ms {call:.1f} ms "
                      "median WeightPublisher.publish on the learner's thread", flush=True)
            (tf, bf, _, _), (td, bd, _, enc) = got["full"], got["delta"]
            print(f"RESULT replicas_{n}_{dtype}_delta_encode_ms {enc:.1f} ms median delta "
                  "encode on the background thread (formerly on the learner's)", flush=True)
            print(f"RESULT replicas_{n}_{dtype}_wire_bytes_delta_over_full {bd / bf:.4f} x "
                  f"bytes sent per version: delta {bd / 1e6:.2f} MB, full {bf / 1e6:.2f} MB "
                  f"({n} x {full_bytes / 1e6:.2f} MB)", flush=True)
            print(f"RESULT replicas_{n}_{dtype}_all_swapped_delta_over_full {td / tf:.2f} x "
                  "one shared 2-core host", flush=True)
            if n == 1 and dtype == "float32":
                hop = tf
    if hop is None or "bfloat16" not in codec:
        return
    ratio, enc, dec = codec["bfloat16"]
    model_bytes, n, link = 7e9 * 2, 64, args.link_gbps * 1e9 / 8
    levels = tree_levels(n, 2)
    full_t = levels * (hop + 2 * model_bytes / link)

    def delta_t(cores: int) -> float:
        return model_bytes / (cores * enc * 1e6) + levels * (
            hop + 2 * ratio * model_bytes / link) + model_bytes / (cores * dec * 1e6)

    note = (f"7B bf16 (14 GB) to {n} replicas, {args.link_gbps:g} Gbit/s links, fan-out 2, "
            f"{levels} levels, hop overhead {hop:.3f} s, delta {ratio:.4f} of the bytes, "
            f"codec {enc:.0f}/{dec:.0f} MB/s per core")
    c = args.codec_cores
    print(f"RESULT model_7b_bf16_64_replicas_relay_full_s {full_t:.1f} s {note}")
    print(f"RESULT model_7b_bf16_64_replicas_relay_delta_s {delta_t(c):.1f} s {note}, "
          f"codec on {c} cores")
    print(f"RESULT model_7b_bf16_64_replicas_relay_delta_1core_s {delta_t(1):.1f} s codec on "
          "one core")
    print(f"RESULT model_7b_bf16_64_replicas_delta_over_full {delta_t(c) / full_t:.3f} x "
          f"codec on {c} cores")


if __name__ == "__main__":
    if sys.argv[1:2] == ["replica"]:
        run_replica(sys.argv[2], sys.argv[3], fanout=2, weight_sync=sys.argv[4])
    else:
        main()
