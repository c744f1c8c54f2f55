"""Timing helper shared by the benchmarks (not a benchmark itself: bench.sh runs only
files without a leading underscore)."""

import time


def best_of(fn, repeats: int) -> float:
    """Shortest wall time of ``repeats`` calls of ``fn()``, in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
