"""Weight fan-out to N sampler replicas: publish -> all-swapped, star versus relay tree.

This process is the learner (``WeightPublisher`` + coordinator, 1 fake CPU device); N replica
processes (1 device each) pull every version through ``jax.experimental.transfer`` over
loopback, either all from the learner (**star**, ``runtime.relay_fanout=0``) or through the
relay tree (**relay**, fan-out 2: ``rlflow.exchange.relay``). For N = 1, 2, 4 it prints

    RESULT replicas_<N>_<star|relay>_all_swapped_s <s> s        publish -> the last replica holds it
    RESULT replicas_<N>_<star|relay>_learner_egress <x> x       learner bytes per version / model bytes
    RESULT replicas_4_relay_vs_star_all_swapped <x> x

(the median over ``--versions`` versions after ``--warmup``). On one CPU host every process
shares the same cores and loopback, so the relay's advantage there is only the learner's
egress (which is what does not scale with N); the link-bound gain shows at pod scale, which
the **fan-out model** prints from the measured per-hop costs:

* per-hop overhead ``a`` (coordinator round trip, relay registration, watchdog polling) and
  loopback bandwidth, fitted from single-replica pulls of two model sizes (``t = a + B / bw``);
* star: the learner's link carries N copies: ``a + N * B / link``;
* relay tree, fan-out f: each holder sends f copies over its link per level, and the holders
  after level L are ``f + f^2 + ... + f^L``: ``L * (a + f * B / link)`` with the least L
  holding every replica. (Store and forward, per version; no chunk pipelining assumed.)

    RESULT model_7b_bf16_64_replicas_star_s <s> s      (link stated in the note)
    RESULT model_7b_bf16_64_replicas_relay_s <s> s
    RESULT model_7b_bf16_64_replicas_relay_vs_star <x> x

Usage: ``python benchmarks/sampler_replicas.py [--mb 32] [--versions 3] [--warmup 1]
[--link-gbps 100]``. Environment ``RLFLOW_BENCH_REPLICAS_MB`` overrides ``--mb``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=1").strip()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _peers import run_replica, stop_peers  # noqa: E402

LEAVES = 8


def params(mb: float, version: int):
    import jax.numpy as jnp

    rows = max(1, int(mb * 2**20 / 4 / LEAVES / 1024))
    return {f"w{i}": jnp.full((rows, 1024), float(version + i), jnp.float32)
            for i in range(LEAVES)}


def measure(n: int, mb: float, relay: bool, versions: int, warmup: int) -> tuple[float, float]:
    """(median publish -> all-swapped seconds, learner egress per version / model bytes)."""
    from rlflow.exchange.coordinator import Coordinator
    from rlflow.exchange.relay import RelayOffers
    from rlflow.exchange.transfer import WeightPublisher

    pub = WeightPublisher(pull_timeout_s=120, layout="single_device")
    offers = RelayOffers(pub, fanout=2 if relay else 10**6, assign_timeout_s=120,
                         num_consumers=n)
    coord = Coordinator(offers).start()
    env = dict(os.environ, PYTHONPATH=REPO)
    peers = [subprocess.Popen([sys.executable, __file__, "replica", f"r{i}", coord.address,
                               "2" if relay else "0"], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for i in range(n)]
    times = []
    try:
        for v in range(warmup + versions):
            tree = params(mb, v)
            t0 = time.time()
            pub.publish(v, tree)
            for p in peers:
                p.stdin.write("pull\n")
                p.stdin.flush()
            done = [float(p.stdout.readline().split()[1]) for p in peers]
            if v >= warmup:
                times.append(max(done) - t0)
        last = max(offers.learner_bytes_by_version)
        egress = offers.learner_bytes_by_version[last] / pub.nbytes
    finally:
        stop_peers(peers, 30)
        coord.close()
    return statistics.median(times), egress


def tree_levels(n: int, fanout: int) -> int:
    """Levels of a fan-out tree (the learner at the root) that reach n replicas."""
    held, level, frontier = 0, 0, 1
    while held < n:
        frontier *= fanout
        held += frontier
        level += 1
    return level


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=float(os.environ.get("RLFLOW_BENCH_REPLICAS_MB",
                                                                     32)))
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--link-gbps", type=float, default=100.0)
    args = ap.parse_args()
    results = {}
    for n in (1, 2, 4):
        for relay in (False, True):
            kind = "relay" if relay else "star"
            t, egress = measure(n, args.mb, relay, args.versions, args.warmup)
            results[(n, kind)] = t
            print(f"RESULT replicas_{n}_{kind}_all_swapped_s {t:.3f} s model {args.mb:g} MB "
                  f"float32, loopback, 1 CPU device per process", flush=True)
            print(f"RESULT replicas_{n}_{kind}_learner_egress {egress:.2f} x "
                  f"learner bytes per version / model bytes (relay target <= 2)", flush=True)
    print(f"RESULT replicas_4_relay_vs_star_all_swapped "
          f"{results[(4, 'relay')] / results[(4, 'star')]:.2f} x (one shared CPU host)")
    # per-hop cost t = a + B / bw from single-replica pulls of two sizes
    small = measure(1, args.mb / 4, False, args.versions, args.warmup)[0]
    big = results[(1, "star")]
    bytes_big, bytes_small = args.mb * 2**20, args.mb / 4 * 2**20
    bw = (bytes_big - bytes_small) / max(big - small, 1e-9)
    a = max(0.0, small - bytes_small / bw)
    print(f"RESULT per_hop_overhead_s {a:.4f} s fitted from {args.mb / 4:g} and {args.mb:g} MB "
          f"pulls (loopback {bw / 1e9:.2f} GB/s)")
    model_bytes, n, link = 7e9 * 2, 64, args.link_gbps * 1e9 / 8
    star = a + n * model_bytes / link
    levels = tree_levels(n, 2)
    relay_t = levels * (a + 2 * model_bytes / link)
    note = f"7B bf16 (14 GB) to {n} replicas, {args.link_gbps:g} Gbit/s per host link"
    print(f"RESULT model_7b_bf16_64_replicas_star_s {star:.1f} s {note}")
    print(f"RESULT model_7b_bf16_64_replicas_relay_s {relay_t:.1f} s {note}, fan-out 2, "
          f"{levels} levels")
    print(f"RESULT model_7b_bf16_64_replicas_relay_vs_star {relay_t / star:.3f} x "
          f"learner egress star {n}x vs relay 2x the model")
    assert math.isfinite(relay_t)


if __name__ == "__main__":
    if sys.argv[1:2] == ["replica"]:
        run_replica(sys.argv[2], sys.argv[3], fanout=int(sys.argv[4]))
    else:
        main()
