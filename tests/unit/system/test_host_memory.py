"""rlflow.system.host_memory: the malloc environment the launcher gives its programs, and
that it does what it is for (a freed large block is reused without page faults)."""

import os
import subprocess
import sys
import textwrap

import pytest

from rlflow.system import host_memory
from rlflow.system.host_memory import KEEP_FREED_MEMORY


def test_allocator_env_adds_the_settings_and_leaves_the_input_alone():
    base = {"PATH": "/bin", "HOME": "/h"}
    out = host_memory.allocator_env(base)
    assert out == {**base, **KEEP_FREED_MEMORY}
    assert base == {"PATH": "/bin", "HOME": "/h"}
    assert host_memory.keeps_freed_memory(out) and not host_memory.keeps_freed_memory(base)


def test_allocator_env_off_or_with_user_settings_changes_nothing():
    base = {"PATH": "/bin"}
    assert host_memory.allocator_env(base, keep_freed=False) == base
    for name in (*KEEP_FREED_MEMORY, "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "GLIBC_TUNABLES"):       # any one of the user's own settings wins
        env = {**base, name: "x"}
        assert host_memory.allocator_env(env) == env, name
        assert host_memory.user_settings(env) == [name]
    assert host_memory.user_settings({**base, "MY_MALLOC_X": "1"}) == []


# A thread (XLA's allocations come from its worker threads) allocates and touches a block
# larger than a thread arena's 64 MiB heap, frees it, and does it again; the child prints
# the minor page faults of the second round and the pages it touched.
_CHILD = textwrap.dedent("""
    import ctypes, resource, threading
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    SIZE = 96 << 20
    out = []

    def rounds():
        for _ in range(2):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            p = libc.malloc(SIZE)
            ctypes.memset(p, 1, SIZE)
            libc.free(p)
            out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    t = threading.Thread(target=rounds)
    t.start(); t.join()
    print(out[1], SIZE // resource.getpagesize())
""")


def _second_round_faults(env) -> tuple[int, int]:
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    faults, pages = map(int, proc.stdout.split())
    return faults, pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_a_freed_large_block_is_reused_without_page_faults():
    plain = {k: v for k, v in os.environ.items()
             if k not in host_memory.user_settings(os.environ)}
    faults, pages = _second_round_faults(plain)
    if faults < pages // 2:
        pytest.skip(f"this host's malloc does not return the block to the kernel "
                    f"({faults} faults for {pages} pages), nothing to compare against")
    kept, _ = _second_round_faults(host_memory.allocator_env(plain))
    assert kept < pages // 20, (kept, pages)


@pytest.mark.parametrize("environ, keep, said", [
    (KEEP_FREED_MEMORY, True, "keeps freed memory for reuse"),
    ({"MALLOC_ARENA_MAX": "4"}, True, "adds nothing: the environment sets MALLOC_ARENA_MAX"),
    (KEEP_FREED_MEMORY, False, None),     # the user's own copy of the values: no credit taken
    ({}, True, None)])
def test_the_learner_log_says_which_settings_it_runs_with(environ, keep, said):
    note = host_memory.startup_note(environ, keep)
    assert note is None if said is None else said in note, note


_TRIM_CHILD = textwrap.dedent("""
    import ctypes, sys
    from rlflow.system.host_memory import release_freed_memory

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) * 1024

    CHUNK, COUNT = 64 << 10, 3200          # 200 MiB of heap blocks (under mmap's threshold)
    blocks = [libc.malloc(CHUNK) for _ in range(COUNT)]
    for p in blocks:
        ctypes.memset(p, 1, CHUNK)
    pinned = libc.malloc(CHUNK)              # keeps the heap's top: free() cannot shrink it
    for p in blocks:
        libc.free(p)
    freed = rss()
    done = release_freed_memory()
    print(int(done), freed, rss(), CHUNK * COUNT)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_release_freed_memory_gives_freed_heap_pages_back():
    """What the sampler calls after a weight swap: freed heap blocks below the heap's top
    stay resident after free() and leave with release_freed_memory()."""
    plain = {k: v for k, v in os.environ.items()
             if k not in host_memory.user_settings(os.environ)}
    proc = subprocess.run([sys.executable, "-c", _TRIM_CHILD], env=plain,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    done, freed, after, size = map(int, proc.stdout.split())
    assert done == 1
    assert freed - after > 0.9 * size, (freed, after, size)
