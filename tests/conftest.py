"""Test-wide set-up: CPU only, 4 fake devices (sharded tests compare against 1 device)."""

import atexit
import concurrent.futures
import os
import shutil
import sys
import tempfile

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# The tests live in tiers (tests/unit/<package>/, tests/e2e/); the helper modules they share
# (hf_fixtures, learner_fixtures, tolerances, repo_paths, ...) stay here in tests/.
# A few test files import another's fixtures or oracles (``from test_engine import ...``):
# every folder holding test files is importable too, after tests/ itself.
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
for _dir, _subdirs, _files in os.walk(TESTS_DIR):
    _subdirs[:] = sorted(d for d in _subdirs if not d.startswith((".", "__")))
    if _dir != TESTS_DIR and _dir not in sys.path and \
            any(f.startswith("test_") and f.endswith(".py") for f in _files):
        sys.path.append(_dir)

# The demo model folder and other caches go to a session tmp folder, never ~/.cache.
os.environ.setdefault("RLFLOW_CACHE_DIR", tempfile.mkdtemp(prefix="rlflow-test-cache-"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags = (flags + " --xla_force_host_platform_device_count=4").strip()
# The tests' one CPU speed setting: XLA:CPU's LLVM back end at -O0. The suite's tiny programs
# spend far longer compiling than running, and -O0 compiles them in about half the CPU time
# (tests/unit/models/test_scan_remat.py: 34 s of CPU against 75 s at the default level). LLVM's levels
# change no float semantics (XLA:CPU never enables fast-math reassociation), and every
# comparison in a test runs both sides under the same flag. Never used outside the tests.
if "xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = flags
# torch serves the tests as a CPU oracle only. On Python >= 3.12 the index's torch is a CUDA
# build that brings triton, which transformers' generation code imports (through
# torch._dynamo); a pytest worker died once with a segmentation fault inside triton's
# extension import, after jax had run. Nothing in the tests needs triton: with None in
# sys.modules ``import triton`` raises ImportError, and torch takes its no-triton path.
sys.modules.setdefault("triton", None)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# One persistent XLA compilation cache for the session, this process and every process a test
# starts (``rlflow train`` runs, learner hosts, replicas): a program compiled once (the demo
# model's train step, its prefill and decode) is loaded, not compiled again, by later tests.
# Programs are keyed by their HLO, devices and compile options, so a hit runs exactly the
# program a compile would have built. Every program is stored, however quickly it compiled
# (a process start-up compiles dozens of small ones).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="rlflow-test-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


GSM8K_TEST = os.path.normpath(os.path.join(TESTS_DIR, "..", "..", "shared", "data", "gsm8k",
                                           "test.jsonl"))


def gsm8k_records():
    """The GSM8K test split (``../shared/data/gsm8k/test.jsonl``) as a list of dicts."""
    import json

    with open(GSM8K_TEST, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def gsm8k_model(tmp_path_factory):
    """One tiny model folder for the GSM8K end-to-end runs (tests/e2e/test_gsm8k_e2e.py,
    tests/e2e/test_episodes_e2e.py; neither writes to it): ``(path, vocab size)`` of
    ``hf_fixtures.make_gsm8k_model_folder`` with the tokenizer trained on the GSM8K test
    questions. Skips when the shared data folder has no GSM8K test file."""
    if not os.path.isfile(GSM8K_TEST):
        pytest.skip(f"GSM8K test file not found at {GSM8K_TEST} (the shared data folder)")
    from hf_fixtures import make_gsm8k_model_folder

    model_dir = str(tmp_path_factory.mktemp("gsm8k-model") / "model")
    vocab = make_gsm8k_model_folder(model_dir, (r["question"] for r in gsm8k_records()))
    return model_dir, vocab


@pytest.fixture(scope="session")
def two_learner_hosts(tmp_path_factory):
    """One 2-host learner run shared by tests/e2e/test_multihost.py and tests/e2e/test_host_shards.py
    (each process start-up builds a learner and compiles its step: the costly part).

    2 processes x 2 fake devices (fsdp=2 x tensor=2, ``mp_jobs.train_multihost``): 3 train
    steps, a checkpoint saved (``ckpt_2h``), one written by 1 host x 2 devices after 1 step
    restored, then each host serves its own shards and this process (the sampler: tensor=4
    on its 4 devices) pulls them from both hosts (``pulled_version``, ``pulled``: flat
    ``{path: jax.Array}``). ``one``: the 1 host x 2 devices learner (a test may restore
    into it; ``one_logits`` are its logits after its step).
    """
    import time

    from flax import nnx

    import mp_jobs
    from rlflow.checkpoint import Checkpointer
    from rlflow.config import MeshConfig
    from rlflow.exchange.host_shards import HostShardPuller
    from rlflow.exchange.transfer import WeightSubscriber
    from rlflow.launcher.local_hosts import kill_all, start_processes, wait_processes
    from rlflow.mesh import make_mesh
    from rlflow.models.hf import build_model

    work = tmp_path_factory.mktemp("two_hosts")
    one = mp_jobs.one_host_two_devices()
    one.train_on(mp_jobs.step_records(7))
    with Checkpointer(str(work / "ckpt_1h"), async_save=False) as ck:
        ck.save(one.checkpoint(), force=True)
    procs_dir = work / "procs"
    procs = start_processes("mp_jobs:train_multihost", num_processes=2, devices_per_process=2,
                            work_dir=procs_dir, extra_paths=[TESTS_DIR],
                            args=dict(ckpt_out=str(work / "ckpt_2h"),
                                      restore_from=str(work / "ckpt_1h")))
    try:
        addrs = []
        for i in range(2):
            path = procs_dir / f"coordinator_{i}.txt"
            deadline = time.monotonic() + 900
            while not path.exists():
                assert time.monotonic() < deadline, "learner host did not publish"
                assert all(p.poll() in (None, 0) for p in procs), [p.poll() for p in procs]
                time.sleep(0.5)
            addrs.append(path.read_text())
        model, _ = build_model(mp_jobs.MODEL, mesh=make_mesh(MeshConfig(tensor=4)))
        puller = HostShardPuller([WeightSubscriber(a, consumer_id="sampler-0", timeout_s=300)
                                  for a in addrs], nnx.split(model, nnx.Param)[1])
        got = None
        deadline = time.monotonic() + 300
        while got is None and time.monotonic() < deadline:
            got = puller.poll()
        puller.close()
    except BaseException:
        kill_all(procs)
        raise
    finally:
        (procs_dir / "done").write_text("")
    results = wait_processes(procs, procs_dir, timeout_s=900)
    assert got is not None, "the sampler got no version from the two learner hosts"
    version, params = got
    return dict(results=results, one=one, one_logits=mp_jobs.logits(one),
                ckpt_2h=str(work / "ckpt_2h"),
                pulled_version=version,
                pulled={k: v[...] for k, v in nnx.to_flat_state(params)})


def pytest_configure(config):
    # RLFLOW_TEST_CPU_JSON=<file>: CPU seconds per test and file (tests/cpu_profile.py).
    if os.environ.get("RLFLOW_TEST_CPU_JSON"):
        import cpu_profile

        cpu_profile.register(config)


@pytest.fixture(scope="session")
def sync_run(tmp_path_factory):
    """tests/e2e_runs.py's one sync-mode ``rlflow train`` (2 learner devices, single-device
    transfer layout, sleeping sampler, 2 decode lanes): ``(CompletedProcess, run folder)``."""
    import e2e_runs

    return e2e_runs.start_sync_run(tmp_path_factory.mktemp("sync-run"))


# pytest-xdist (scripts/test.sh runs ``-n <workers> --dist loadgroup``): each test file runs
# on one worker, as ``--dist loadfile`` would, so its module fixtures are built once; files
# that share a session fixture of the list below (found from the tests' fixture names) run on
# the same worker, which builds it once.
SHARED_SESSION_FIXTURES = ("two_learner_hosts", "gsm8k_model", "sync_run")


def xdist_groups(items) -> dict[str, str]:
    """``{test file path: group name}``: a file's own path, or one name for all the files
    that share (transitively) one of SHARED_SESSION_FIXTURES."""
    parent: dict[str, str] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for item in items:
        path = str(item.fspath)
        for name in SHARED_SESSION_FIXTURES:
            if name in getattr(item, "fixturenames", ()):
                parent[find(path)] = find("fixture:" + name)
    return {str(item.fspath): find(str(item.fspath)) for item in items}


# pytest-xdist's --dist loadgroup schedules by a suffix on each test id, ``<nodeid>@<group>``,
# that its worker appends in its own pytest_collection_modifyitems (to ``item._nodeid``). Under
# pytest 9 that no longer changes the id (``Node.nodeid`` is ``str(item._id)``), and the worker's
# hook ran before this one anyway (it is registered later, so called first) and saw no marker:
# every file's tests were spread over the workers, each building the file's module fixtures and
# the shared runs. This hook runs last and writes the suffix itself where it is missing.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    groups = xdist_groups(items)
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = groups[str(item.fspath)]
            name = group.split(":", 1)[1] if group.startswith("fixture:") else \
                os.path.relpath(group, TESTS_DIR)
            item.add_marker(pytest.mark.xdist_group(name))
        if getattr(config.option, "loadgroup", False):      # an xdist worker, --dist loadgroup
            _suffix_group(item)


def _suffix_group(item) -> None:
    """Append ``@<xdist_group name>`` to ``item``'s test id unless it is there already."""
    name = item.get_closest_marker("xdist_group").args[0]
    nodeid = item.nodeid
    if nodeid.endswith("@" + name):
        return
    nodeid = f"{nodeid}@{name}"
    if hasattr(item, "_id"):                        # pytest >= 9: the id is a NodeId
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(nodeid)
    else:
        item._nodeid = nodeid


class _CompileWhenNeeded(concurrent.futures.Future):
    """A ``Future`` of a compile that runs on the thread that first asks for its result."""

    def __init__(self, compile_fn):
        super().__init__()
        self._compile_fn = compile_fn

    def result(self, timeout=None):
        if not self.done():
            try:
                self.set_result(self._compile_fn())
            except BaseException as e:  # noqa: BLE001 - re-raised by result(), as a thread's
                self.set_exception(e)
        return super().result(timeout)


@pytest.fixture(autouse=True)
def _worst_case_compiled_when_needed(request, monkeypatch):
    """A packed Learner compiles the worst-case row count on a background thread after its
    first step (``Learner.compiled_step``); the unit tests' learners take a step or two and
    almost never need it, and each background compile cost as much CPU as the step's own.
    Here the compile is deferred to the step that needs it (same program, same arguments:
    what a step computes is unchanged). Tests marked ``background_compile`` keep the thread
    (tests/unit/learner/test_packing.py checks it); ``rlflow train`` processes are untouched."""
    trainer = sys.modules.get("rlflow.learner.trainer")
    if trainer is None or request.node.get_closest_marker("background_compile"):
        return

    def deferred(self, rows, seq):
        args = self._abstract_args(rows, seq)      # taken now: a step donates the buffers
        return _CompileWhenNeeded(lambda: self._compile(rows, seq, args))
    monkeypatch.setattr(trainer.Learner, "_compile_in_background", deferred)
