"""Ring-buffer throughput over loopback: a producer process -> the ZeroMQ buffer server.

The producer (a separate process, like a sampler) sends realistic group records as fast as
the server accepts them; the consumer (this process, like the learner) takes them in
batches with ``get_groups``. Printed per record size::

    RESULT buffer_<size>_<mode>_records_per_s <value> records/s
    RESULT buffer_<size>_<mode>_MB_per_s <value> MB/s

for two producer modes: ``single`` (``put_group``, one round trip per group) and
``batch<k>`` (``put_groups`` of k groups per round trip); plus, as a same-run baseline, a
single-thread numpy copy of the same bytes and the ratio.

Usage: ``python benchmarks/buffer_throughput.py [--seconds 4]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlflow.exchange import records  # noqa: E402
from rlflow.exchange.buffer import BufferClient, BufferServer  # noqa: E402
from rlflow.exchange.ring import RingBuffer  # noqa: E402

# name -> (group_size G, max_tokens T, prompt_len P): GSM8K-like and long-reasoning groups.
SIZES = {"g8_t512": (8, 512, 128), "g16_t4096": (16, 4096, 512)}
BATCH = 8  # groups per get_groups call (a learner step's worth)
PUT_BATCH = 8  # groups per put_groups call in the batched mode


def make_groups(size: str, n: int = 16) -> list[dict]:
    G, T, P = SIZES[size]
    rng = np.random.default_rng(0)
    return [records.synthetic_group(rng, group_size=G, max_tokens=T, prompt_len=P, version=1,
                                    prompt_id=i) for i in range(n)]


def produce(address: str, size: str, count: int, batch: int) -> None:
    groups = make_groups(size)
    with BufferClient(address, timeout_s=120, name="bench-producer") as client:
        if batch <= 1:
            for i in range(count):
                client.put_group(groups[i % len(groups)])
            return
        client.put_group(groups[0])  # the consumer starts its clock on this one
        for start in range(1, count, batch):
            chunk = [groups[i % len(groups)] for i in range(start, min(start + batch, count))]
            assert not client.put_groups(chunk)


def measure(size: str, seconds: float, batch: int) -> tuple[float, float, float]:
    """Returns (records/s, MB/s, numpy-copy MB/s) for one record size."""
    group_bytes = records.group_nbytes(make_groups(size, 1)[0])
    # about `seconds` of traffic at ~100 MB/s or ~1000 records/s, at least 20 batches
    count = BATCH * max(20, int(seconds * min(1000, 100e6 / group_bytes) / BATCH))
    server = BufferServer(RingBuffer(64, timeout_s=120)).start()
    proc = subprocess.Popen([sys.executable, __file__, "--produce", server.address, size,
                             str(count), str(batch)])
    try:
        server.get_groups(1, timeout=120)  # the producer is up: start the clock
        got, nbytes = 1, 0
        t0 = time.perf_counter()
        while got < count:
            batch = server.get_groups(min(BATCH, count - got), timeout=120)
            nbytes += sum(records.group_nbytes(g) for g in batch)
            got += len(batch)
        dt = time.perf_counter() - t0
        assert proc.wait(60) == 0, "producer failed"
    finally:
        if proc.poll() is None:
            proc.kill()
        server.close()
    n = count - 1
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    copies = []
    for _ in range(3):
        c0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - c0)
    return n / dt, nbytes / dt / 1e6, nbytes / min(copies) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="traffic per record size")
    ap.add_argument("--produce", nargs=4, metavar=("ADDRESS", "SIZE", "COUNT", "BATCH"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.produce:
        produce(args.produce[0], args.produce[1], int(args.produce[2]), int(args.produce[3]))
        return
    for size in SIZES:
        G, T, P = SIZES[size]
        kb = records.group_nbytes(make_groups(size, 1)[0]) / 1e3
        print(f"# {size}: G={G} T={T} P={P}, {kb:.0f} kB per group")
        for mode, batch in (("single", 1), (f"batch{PUT_BATCH}", PUT_BATCH)):
            rps, mbps, copy_mbps = measure(size, args.seconds, batch)
            print(f"RESULT buffer_{size}_{mode}_records_per_s {rps:.0f} records/s")
            print(f"RESULT buffer_{size}_{mode}_MB_per_s {mbps:.0f} MB/s")
            print(f"RESULT numpy_copy_{size}_MB_per_s {copy_mbps:.0f} MB/s")
            print(f"RESULT buffer_{size}_{mode}_vs_numpy_copy {copy_mbps / mbps:.1f} x slower")


if __name__ == "__main__":
    main()
