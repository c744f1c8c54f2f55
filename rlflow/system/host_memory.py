"""glibc malloc settings for the learner program's process: keep freed memory for reuse.

Why: on the CPU backend every execution of a compiled step allocates its temporaries
(``compiled.memory_analysis().temp_size_in_bytes``: 316 MiB for the learner step of the
4.5M-parameter GSM8K model on 4 packed rows of 384 tokens) with ``posix_memalign`` from
XLA's worker threads, and frees them when the step ends. glibc serves a request that large
from a fresh ``mmap`` (a thread's own arena cannot hold more than 64 MiB, so even a raised
``M_MMAP_THRESHOLD`` does not help) and ``munmap``s it on free, so every step page-faults
all of it in again: ~90k minor faults and 150-200 ms of kernel time per step there, 20% of
the step (``benchmarks/learner_vs_torch.py``; measured with ``getrusage`` and ``strace``).

The three variables below (read by glibc when a process starts, so ``rlflow train`` sets them
in the environment it starts its learner program with) route every allocation to the main
arena (``MALLOC_ARENA_MAX=1``), serve it from the heap instead of ``mmap``
(``MALLOC_MMAP_MAX_=0``) and never give the heap's top back to the kernel
(``MALLOC_TRIM_THRESHOLD_``): the next step reuses the same pages, with no faults. The
cost is that a process's resident memory stays at its peak, as with a caching allocator.
It pays where XLA runs the step on its worker threads (>= 2 cores); a learner pinned to one
core faulted nothing with either setting. Only the learner program gets them: with one
arena the sampler's two decode lanes (two threads dispatching decode calls) ran slower,
best of 8 runs 3994 and 5073 tok/s against 4967 and 5766 with the system's settings (two
A/Bs, 4.46M model, 2-core host).

Other C libraries (musl, macOS) ignore the variables. A user whose environment sets any
``MALLOC_*`` variable or ``GLIBC_TUNABLES`` keeps their own settings (nothing is added).
"""

from __future__ import annotations

from typing import Mapping

KEEP_FREED_MEMORY = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),       # bytes: 1 TiB, i.e. never trim
}


def user_settings(env: Mapping[str, str]) -> list[str]:
    """The malloc settings of ``env`` that are the user's own: every ``MALLOC_*`` variable
    and ``GLIBC_TUNABLES``, sorted (none of ours: call it on the user's environment)."""
    return sorted(k for k in env if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")


def allocator_env(env: Mapping[str, str], keep_freed: bool = True) -> dict[str, str]:
    """``env`` plus :data:`KEEP_FREED_MEMORY` when ``keep_freed`` and ``env`` has no
    :func:`user_settings` (those are the user's choice and are left as they are).

    Args:
      env: a process environment (not modified).
      keep_freed: ``runtime.keep_freed_host_memory``.

    Returns: a new dict, the environment to start the process with.
    """
    out = dict(env)
    if keep_freed and not user_settings(env):
        out.update(KEEP_FREED_MEMORY)
    return out


def keeps_freed_memory(env: Mapping[str, str]) -> bool:
    """Whether ``env`` (a started process's environment) holds :data:`KEEP_FREED_MEMORY`."""
    return all(env.get(k) == v for k, v in KEEP_FREED_MEMORY.items())


def startup_note(env: Mapping[str, str], keep_freed: bool) -> str | None:
    """What a learner started with ``env`` logs about these settings, or None: that it runs
    with them, or that the user's own (:func:`user_settings`) made ``rlflow train`` add
    nothing. None when ``keep_freed`` (``runtime.keep_freed_host_memory``) is off."""
    if not keep_freed:
        return None
    if keeps_freed_memory(env):
        return "glibc malloc keeps freed memory for reuse (runtime.keep_freed_host_memory)"
    own = user_settings(env)
    return (f"runtime.keep_freed_host_memory adds nothing: the environment sets "
            f"{', '.join(own)}") if own else None


def release_freed_memory() -> bool:
    """Give the pages of freed heap memory back to the kernel (glibc ``malloc_trim(0)``,
    which also releases free pages inside the heap, not only at its top); True when it
    did (False elsewhere: no glibc, or a C library without it).

    Why: the sampler program frees a whole weight version at every swap (and its start-up
    weights once the first version arrives); glibc keeps most of that memory in its heap
    for reuse, where later allocations of other sizes leave it unused, so without this the
    sampler's resident memory grew by about a version per swap (SmolLM2-135M, float32:
    2.01 -> 2.20 GiB over two swaps with 0.72 GiB of live arrays; measured 2026-12-07 on
    the 2-core CPU test machine). Called after such frees, never per decode step (a trim
    walks the heap). Not for the learner, whose heap is kept on purpose
    (:data:`KEEP_FREED_MEMORY`).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim(0)
    return True
