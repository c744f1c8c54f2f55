"""Weight publish-to-swap latency over loopback, against a numpy copy of the same bytes.

A learner process (its own JAX runtime, 2 fake CPU devices, leaves sharded over ``fsdp``)
publishes versions of W bytes of float32 leaves through ``WeightPublisher`` + coordinator;
this process is the sampler (2 fake CPU devices): it polls, pulls in the learner's layout,
re-lays onto its own shardings and swaps. Publish-to-swap is the wall
time from the learner starting ``publish`` to the sampler holding the new arrays (same-host
clock). The baseline is a single-thread ``np.copyto`` of W bytes in this run (also shown:
a copy into a fresh buffer, and a copy split over as many threads as the transfer has
connections, one per device). Printed::

    RESULT numpy_copy_<W>MB <ms> ms
    RESULT weight_publish_to_swap_<W>MB_<case> <ms> ms
    RESULT weight_swap_vs_numpy_copy_<W>MB_<case> <ratio> x     (target <= 3)
    RESULT weight_sampler_pause_<W>MB_<case> <ms> ms            (re-layout + swap)
    RESULT weight_decode_pause_<W>MB_same_layout_decoding <ms> ms  (pause vs transfer, below)

    RESULT raw_socket_<n>stream_<W>MB <ms> ms                  (the link alone)
    RESULT weight_swap_vs_raw_socket_<W>MB_<case> <ratio> x     (1: the link is the limit)
    RESULT raw_socket_<n>stream_cpu_<W>MB <ms> ms              (CPU time, both ends)
    RESULT weight_cpu_<W>MB_<case> <ms> ms                     (CPU time, both processes)

The raw-socket lines send the same W bytes buffer to buffer over loopback TCP with plain
sockets, over 1 connection and over as many as the transfer server has transports: the
floor of any socket transfer on this host, so ``weight_swap_vs_numpy_copy`` can be read
against it (a target below ``raw_socket_..._vs_numpy_copy`` is below what the link allows).

(and the parts: publish = the learner's ``publish`` call, which returns before its device
copy is done, as in the runtime (``publish_copy``: when the copy was done; it overlaps the
pull; ``--serial-publish`` waits for it before the sampler polls, the order of the figures
before 2026-12-01); pull = first request to last byte; other = coordinator round trip and
Python) for two cases: ``same_layout`` (the sampler keeps the
learner's split, so nothing is re-laid) and ``resharded`` (rows -> columns: a full re-layout
on the sampler, which the CPU backend does slowly).

The first rounds are slow while the allocators of both processes warm up (fresh pages on
every pull); ``--warmup`` rounds (default 5) are not counted, so the figures are the steady
state of a run that swaps weights every step.

Pause vs transfer (issue 53): the case ``same_layout_decoding`` runs a stand-in decode loop
(a fixed float32 matmul per step, on its own thread, as the sampler's decode thread) while
this thread pulls, as rlflow's background puller does; the decode time the version cost is
measured as in the sampler program (:class:`rlflow.sampler.weight_pause.SwapPauseMeter`:
each step's excess over the baseline step, split into pull, cast = re-layout and install =
the step that takes the new arrays) and printed beside the transfer (pull) time::

    RESULT weight_decode_pause_<W>MB_same_layout_decoding <ms> ms decode time lost
        (pull <ms>, cast <ms>, install <ms>) vs transfer <ms> ms (<ratio> x)

The CPU lines are what bounds the latency on a host with few cores (every copy of both
processes shares them), and they hold still when other jobs load the machine.

Usage: ``python benchmarks/weight_transfer.py [--mb 50 200] [--repeats 3] [--warmup 5]
[--serial-publish]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

DEVICES = 2
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={DEVICES}").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

LEAVES = 8


def leaf_shape(mb: int) -> tuple[int, int]:
    rows = max(DEVICES, (mb * 2**20 // 4 // LEAVES) // 1024 // DEVICES * DEVICES)
    return rows, 1024


def learner(mb: int, serial: bool, donated: bool) -> None:
    """Peer process: on "publish <v>" publish version v, print its start time and how long
    ``publish`` took, then (once the device copy is done) how long the copy took.
    ``donated``: as a train step that donates its params (the same arrays every version,
    published through a device copy); else as ``rlflow train``'s learner, whose step keeps
    its params: each version is a new set of arrays (made before the clock starts, as the
    step makes them) published as they are.
    ``serial``: wait for the copy before telling the sampler (no overlap with the pull)."""
    from rlflow.exchange.coordinator import Coordinator
    from rlflow.exchange.transfer import WeightPublisher

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    shape = leaf_shape(mb)
    params = {f"w{i}": jax.device_put(np.full(shape, i, np.float32),
                                      NamedSharding(mesh, P("fsdp", None)))
              for i in range(LEAVES)}
    step = jax.jit(lambda tree: jax.tree.map(jax.numpy.copy, tree))  # new output buffers
    pub = WeightPublisher(pull_timeout_s=300, donated=donated)
    coord = Coordinator(pub).start()
    print("READY", coord.address, flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[:1] == ["publish"]:
            if not donated:
                params = jax.block_until_ready(step(params))
            t0, c0 = time.time(), time.process_time()
            pub.publish(int(cmd[1]), params)
            if serial:
                jax.block_until_ready(pub._current[1])
            print("PUBLISHED", cmd[1], t0, time.time() - t0, flush=True)
            jax.block_until_ready(pub._current[1])
            print("COPIED", time.time() - t0, flush=True)
        elif cmd[:1] == ["cpu"]:  # CPU seconds of this process since the last publish started
            print("CPU", time.process_time() - c0, flush=True)
        elif cmd[:1] == ["quit"]:
            break
    coord.close()


def numpy_copy_s(nbytes: int, repeats: int, warmup: int) -> tuple[float, float, float]:
    """Median seconds of a numpy copy of ``nbytes``: single-thread into a warm, reused
    buffer (``np.copyto``, the headline baseline), into a fresh one (``np.copy``, which
    allocates like a pull does), and split over ``DEVICES`` threads into a reused buffer."""
    from concurrent.futures import ThreadPoolExecutor

    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    cuts = [nbytes * i // DEVICES for i in range(DEVICES + 1)]
    bounds = list(zip(cuts[:-1], cuts[1:]))
    pool = ThreadPoolExecutor(DEVICES)
    warm, fresh, threaded = [], [], []
    for _ in range(warmup + repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        warm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = np.copy(src)
        fresh.append(time.perf_counter() - t0)
        del out
        t0 = time.perf_counter()
        list(pool.map(lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds))
        threaded.append(time.perf_counter() - t0)
    pool.shutdown()
    return tuple(float(np.median(x[warmup:])) for x in (warm, fresh, threaded))


def raw_socket_s(nbytes: int, streams: int, repeats: int,
                 warmup: int) -> tuple[float, float]:
    """Median seconds to send ``nbytes`` from one buffer into another over loopback TCP,
    split over ``streams`` connections (one sender and one receiver thread each; both
    release the GIL in ``sendall`` / ``recv_into``): the link alone, no framework. Also
    the median CPU seconds (both ends: ``time.process_time``) one send costs."""
    import socket
    import threading

    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    cuts = [nbytes * i // streams for i in range(streams + 1)]
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    pairs = []
    for _ in range(streams):
        out = socket.create_connection(("127.0.0.1", port))
        inc, _ = listener.accept()
        pairs.append((out, inc))
    listener.close()

    def send(sock, lo, hi):
        sock.sendall(memoryview(src)[lo:hi])

    def recv(sock, lo, hi):
        view = memoryview(dst)[lo:hi]
        while len(view):
            view = view[sock.recv_into(view):]

    times, cpu = [], []
    for _ in range(warmup + repeats):
        threads = [threading.Thread(target=f, args=(sock, lo, hi))
                   for (out, inc), lo, hi in zip(pairs, cuts[:-1], cuts[1:])
                   for f, sock in ((recv, inc), (send, out))]
        t0, c0 = time.perf_counter(), time.process_time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    for out, inc in pairs:
        out.close()
        inc.close()
    assert dst[-1] == 1
    return float(np.median(times[warmup:])), float(np.median(cpu[warmup:]))


def sampler(mb: int, repeats: int, warmup: int, serial: bool) -> None:
    mesh = Mesh(np.array(jax.devices()), ("tensor",))
    same = NamedSharding(mesh, P("tensor", None))  # the learner's split: nothing is re-laid
    cases = [  # (name, the learner donates its params, the sampler's sharding)
        ("same_layout", False, same),
        ("resharded", False, NamedSharding(mesh, P(None, "tensor"))),
        ("same_layout_donated", True, same),
        ("same_layout_decoding", False, same),   # a decode loop runs during the pull
    ]
    results, pauses, transports = {}, {}, 1
    for donated in (False, True):
        params, sub = _run_cases(mb, repeats, warmup, serial, donated,
                                 [(n, sh) for n, d, sh in cases if d == donated], results,
                                 pauses)
        transports = sub.transports
    report(mb, params, results, transports, repeats, warmup, serial, pauses)


class DecodeStandIn:
    """A decode loop on its own thread: one fixed matmul per step, each step noted in a
    :class:`rlflow.sampler.weight_pause.SwapPauseMeter`; :meth:`install` makes the next
    step the one that swaps a version in, and returns once it ran."""

    def __init__(self, n: int = 256):
        import threading

        from rlflow.sampler.weight_pause import SwapPauseMeter

        rng = np.random.default_rng(0)
        self.a, self.b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
        self.meter = SwapPauseMeter()
        self._pending, self._done = None, threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            swapped, self._pending = self._pending, None
            for _ in range(4):
                self.a @ self.b
            self.meter.step(t0, time.monotonic(), swapped_to=swapped)
            if swapped is not None:
                self._done.set()

    def install(self, version: int) -> None:
        self._done.clear()
        self._pending = version
        self._done.wait(30)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _run_cases(mb, repeats, warmup, serial, donated, cases, results, pauses):
    """One learner process (``donated`` or not), the sampler's ``cases`` against it; fills
    ``results[name]`` with the median row of ms figures (and ``pauses[name]``, for a case
    with a decode loop: pause, its pull / cast / install parts, transfer, ms). Returns the
    last params and the subscriber."""
    from rlflow.exchange.transfer import WeightSubscriber
    from rlflow.system.host_memory import allocator_env

    # the learner process with the malloc settings rlflow train gives its learner program
    proc = subprocess.Popen([sys.executable, __file__, "--learner", str(mb)] +
                            (["--serial-publish"] if serial else []) +
                            (["--donated"] if donated else []), env=allocator_env(os.environ),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready = proc.stdout.readline().split()
        assert ready[:1] == ["READY"], ready
        sub = WeightSubscriber(ready[1], consumer_id="bench-sampler", timeout_s=300)
        version = 0
        for case, sharding in cases:
            sub.target = {f"w{i}": sharding for i in range(LEAVES)}
            params = None
            rows, pause_rows = [], []
            decode = DecodeStandIn() if case.endswith("_decoding") else None
            for r in range(warmup + repeats):  # warm-up: connections, allocator, page faults
                proc.stdin.write(f"publish {version}\n")
                proc.stdin.flush()
                _, _, t_start, t_publish = proc.stdout.readline().split()
                c0 = time.process_time()
                p0 = time.monotonic()
                got, new = sub.poll()
                p1 = time.monotonic()
                s0 = time.perf_counter()
                params = new  # the swap: the sampler's engine takes this pytree
                swap_s = time.perf_counter() - s0
                t_done = time.time()
                cpu_sampler = time.process_time() - c0
                if decode is not None:
                    relayout = min(sub.metrics["last_relayout_s"], p1 - p0)
                    decode.meter.note(version, "pull", p0, p1 - relayout)
                    decode.meter.note(version, "cast", p1 - relayout, p1)
                    decode.install(version)
                    if r >= warmup:
                        m = decode.meter.latest
                        pause_rows.append([m[k] for k in ("pause", "pull", "cast", "install",
                                                          "transfer")])
                copy_s = float(proc.stdout.readline().split()[1])
                proc.stdin.write("cpu\n")
                proc.stdin.flush()
                cpu_learner = float(proc.stdout.readline().split()[1])
                assert got == version and float(np.asarray(params["w3"][0, 0])) == 3.0
                if r >= warmup:
                    rows.append((t_done - float(t_start), float(t_publish),
                                 sub.metrics["last_pull_s"],
                                 sub.metrics["last_relayout_s"] + swap_s, copy_s,
                                 cpu_learner, cpu_sampler))
                version += 1
            results[case] = np.median(np.array(rows), axis=0) * 1e3  # ms
            if decode is not None:
                decode.close()
                pauses[case] = np.median(np.array(pause_rows), axis=0) * 1e3  # ms
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return params, sub


def report(mb, params, results, transports, repeats, warmup, serial, pauses=None) -> None:
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    base, fresh, threaded = (t * 1e3 for t in numpy_copy_s(nbytes, repeats, warmup))
    link = {n: [t * 1e3 for t in raw_socket_s(nbytes, n, repeats, min(warmup, 2))]
            for n in sorted({1, transports})}
    name = f"{round(nbytes / 2**20)}MB"
    print(f"# {name}: {LEAVES} float32 leaves; learner {DEVICES} devices P('fsdp', None); "
          f"sampler {DEVICES} devices; median of {repeats} after {warmup} warm-up rounds; "
          "_donated: a learner whose step donates its params, published through a device copy"
          + (" (serial publish: copy done before the offer)" if serial else
             " (publish returns before its copy is done)"))
    print(f"RESULT numpy_copy_{name} {base:.1f} ms np.copyto into a reused buffer (baseline)")
    print(f"RESULT numpy_copy_fresh_{name} {fresh:.1f} ms np.copy into a new buffer")
    print(f"RESULT numpy_copy_{DEVICES}threads_{name} {threaded:.1f} ms")
    for n, (ms, cpu_ms) in link.items():
        print(f"RESULT raw_socket_{n}stream_{name} {ms:.1f} ms loopback TCP, {n} connection(s), "
              f"buffer to buffer ({nbytes / ms / 1e6:.2f} GB/s): the link alone")
        print(f"RESULT raw_socket_{n}stream_vs_numpy_copy_{name} {ms / base:.2f} x the floor "
              f"any socket transfer of these bytes has on this host")
        print(f"RESULT raw_socket_{n}stream_cpu_{name} {cpu_ms:.1f} ms CPU time, both ends")
    floor = min(ms for ms, _ in link.values())
    floor_cpu = min(cpu_ms for _, cpu_ms in link.values())
    for case, (latency, publish, pull, pause, copy, cpu_l, cpu_s) in results.items():
        cpu = cpu_l + cpu_s
        print(f"RESULT weight_publish_{name}_{case} {publish:.1f} ms")
        if case.endswith("_donated"):
            print(f"RESULT weight_publish_copy_{name}_{case} {copy:.1f} ms the learner's device "
                  "copy, from publish start" + ("" if serial else " (overlaps the pull)"))
        print(f"RESULT weight_pull_{name}_{case} {pull:.1f} ms")
        print(f"RESULT weight_other_{name}_{case} {latency - publish - pull - pause:.1f} ms")
        print(f"RESULT weight_publish_to_swap_{name}_{case} {latency:.1f} ms")
        print(f"RESULT weight_swap_vs_numpy_copy_{name}_{case} {latency / base:.2f} x "
              "target<=3")
        print(f"RESULT weight_sampler_pause_{name}_{case} {pause:.1f} ms")
        print(f"RESULT weight_cpu_{name}_{case} {cpu:.1f} ms CPU time of both processes per "
              f"version ({cpu / floor_cpu:.2f} x the raw socket's; learner {cpu_l:.1f}, sampler "
              f"{cpu_s:.1f}): what bounds the latency on a host with few cores")
        print(f"RESULT weight_swap_vs_raw_socket_{name}_{case} {latency / floor:.2f} x "
              f"publish-to-swap over the fastest raw-socket send of the same bytes (1: the "
              f"link is the limit)")
    for case, (pause, pull, cast, install, transfer) in (pauses or {}).items():
        print(f"RESULT weight_decode_pause_{name}_{case} {pause:.1f} ms decode time lost "
              f"(pull {pull:.1f}, cast {cast:.1f}, install {install:.1f}) vs transfer "
              f"{transfer:.1f} ms ({pause / max(transfer, 1e-9):.2f} x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, nargs="+", default=[50, 200], help="weight sizes W, MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5, help="rounds not counted")
    ap.add_argument("--serial-publish", action="store_true",
                    help="the learner waits for its device copy before the sampler polls "
                         "(the figures before the copy overlapped the pull)")
    ap.add_argument("--learner", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--donated", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.learner is not None:
        learner(args.learner, args.serial_publish, args.donated)
        return
    for mb in args.mb:
        sampler(mb, args.repeats, args.warmup, args.serial_publish)


if __name__ == "__main__":
    main()
