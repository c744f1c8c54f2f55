"""Peer processes of the weight-sync benchmarks (driven line by line over stdin/stdout; not a
benchmark itself: bench.sh runs only files without a leading underscore)."""

from __future__ import annotations

import subprocess
import sys
import time


def run_replica(name: str, address: str, fanout: int, weight_sync: str = "full") -> None:
    """A replica process's loop (``WeightSubscriber`` of the coordinator at ``address``,
    relay fan-out ``fanout``): on ``pull`` it polls until it holds a newer version, then
    prints ``DONE <unix time> <delta pulls so far>``; ``quit`` ends it."""
    from rlflow.exchange.transfer import WeightSubscriber

    sub = WeightSubscriber(address, consumer_id=name, timeout_s=120, retries=2,
                           relay_fanout=fanout, relay_timeout_s=120, weight_sync=weight_sync)
    for line in sys.stdin:
        if line.strip() == "pull":
            have = sub.version
            while True:
                got = sub.poll()
                if got is not None and got[0] > have:
                    break
                time.sleep(0.002)
            print("DONE", time.time(), sub.metrics["delta_pulls"], flush=True)
        elif line.strip() == "quit":
            break
    sub.close()


def stop_peers(peers, timeout_s: float) -> None:
    """Ask each peer ``subprocess.Popen`` to quit (``quit`` on its stdin) and wait up to
    ``timeout_s`` seconds for it; kill one that cannot be told or does not exit."""
    for p in peers:
        try:
            p.stdin.write("quit\n")
            p.stdin.flush()
            p.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            p.kill()
