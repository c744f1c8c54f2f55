"""Peer processes of the weight-sync benchmarks (driven line by line over stdin/stdout; not a
benchmark itself: bench.sh runs only files without a leading underscore)."""

from __future__ import annotations

import subprocess


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
