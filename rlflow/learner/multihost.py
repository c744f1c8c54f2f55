"""A learner over several hosts: multi-controller JAX (one process per host of the slice).

Every host of the learner slice runs the same program: :func:`initialize` joins it to the
others (``jax.distributed``; on CPU with gloo collectives), :func:`global_mesh` builds the
``(data, fsdp, expert, sequence, tensor)`` mesh over all hosts' devices with the usual
logical-axis rules, and the jitted train step of :class:`rlflow.learner.trainer.Learner`
runs unchanged on it. Only host 0 (``jax.process_index() == 0``) holds the rollout records and builds each step's batch;
:func:`distribute_batch` broadcasts it and every host then builds *its own rows* of the global
batch arrays (``jax.make_array_from_process_local_data``) under
:func:`rlflow.mesh.batch_sharding`::

    multihost.initialize(DistributedConfig("10.0.0.2:8476", num_processes=2, process_id=i))
    learner = Learner(cfg, mesh=multihost.global_mesh(cfg.learner.mesh))
    batch = learner.build_batch(records)[0] if jax.process_index() == 0 else None
    metrics, info = multihost.train_step(learner, batch)    # every host calls it

Failure model: ``jax.distributed.initialize`` on a host that cannot reach the coordinator
aborts the process (a C++ fatal error, no Python exception) after its timeout, so
:func:`initialize` first waits for the coordinator's TCP port itself and raises
:class:`CoordinatorUnreachable` naming the host and address. A host that dies later makes the
coordination service terminate the others (their logs name the missing task).
"""

from __future__ import annotations

import math
import socket
import time
from dataclasses import dataclass
from typing import Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from rlflow.learner.batch import BatchError, TrainBatch, with_sequence_ids
from rlflow.learner.trainer import pull_metrics
from rlflow.mesh import batch_sharding, make_mesh
from rlflow.models.decoder import TokenRangeError


class DistributedError(RuntimeError):
    """The learner hosts could not be joined; the message names the host and what failed."""


class CoordinatorUnreachable(DistributedError):
    """A learner host could not open a TCP connection to the coordinator within the timeout."""


@dataclass(frozen=True)
class DistributedConfig:
    """How this process joins the learner program.

    Attributes:
      coordinator_address: ``host:port`` of learner host 0's coordination service.
      num_processes: learner hosts (one process per host).
      process_id: this host's index in ``[0, num_processes)``; 0 runs the coordinator.
      init_timeout_s: seconds to wait for the coordinator / all hosts to join.
      heartbeat_timeout_s: seconds without a heartbeat after which the coordination service
        declares a host dead and terminates every other host (their logs name it: "Task N
        heartbeat timeout"). On CPU a collective with a dead host fails at once (gloo:
        "Connection closed by peer"); the other hosts then exit after this timeout.
    """
    coordinator_address: str
    num_processes: int
    process_id: int
    init_timeout_s: float = 300.0
    heartbeat_timeout_s: float = 100.0

    def __post_init__(self):
        host, _, port = self.coordinator_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"coordinator_address: expected 'host:port', got "
                             f"{self.coordinator_address!r}")
        if self.num_processes < 1:
            raise ValueError(f"num_processes: expected >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id: expected 0 <= process_id < num_processes = "
                             f"{self.num_processes}, got {self.process_id}")
        if not self.init_timeout_s > 0:
            raise ValueError(f"init_timeout_s: expected > 0, got {self.init_timeout_s}")
        if not self.heartbeat_timeout_s >= 1:
            raise ValueError(f"heartbeat_timeout_s: expected >= 1, got "
                             f"{self.heartbeat_timeout_s}")


def use_gloo_collectives() -> None:
    """Select gloo for cross-process collectives on CPU (call before the backend starts;
    TPU/GPU backends ignore this setting)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def same_program_on_every_host() -> None:
    """Leave the Python call stack out of every program this process lowers
    (``jax_traceback_in_locations_limit = 0``), so that a program spanning the hosts is the
    same program on each of them whatever code path reached it.

    jax writes the Python traceback of each operation into the HLO as source-location
    metadata (up to ``jax_traceback_in_locations_limit`` frames, default 100), and the
    learner's hosts reach the same cross-host program from different call sites: host 0
    from :class:`rlflow.learner.program.LearnerProgram`, the others from
    :func:`rlflow.learner.hosts.follower_main` (``HostCommands.send`` on host 0 and
    ``HostCommands.receive`` elsewhere are two lines calling one ``broadcast_one_to_all``; the
    train step and :func:`distribute_batch` are traced under ``dispatch_step`` on host 0 and
    ``train_step`` elsewhere). Those programs then differ only in that metadata, and with
    jax 0.12.1 on CPU such a pair hangs in its first gloo collective: every host waits in
    ``gloo::allreduce`` / ``waitRecv`` for ever (jax 0.10.2 ran the pair; likely the
    CPU client's collective launch key comes from the executable's fingerprint, which
    covers the metadata, so the hosts' launches never meet).
    Reproduced by two processes calling ``broadcast_one_to_all`` from two source lines
    (``tests/mp_jobs.py:commands_from_two_call_sites``); with no frames in the locations
    both hosts lower byte-identical HLO and it runs. Costs only source lines in profiles
    and HLO dumps (op names stay)."""
    jax.config.update("jax_traceback_in_locations_limit", 0)


def no_cached_executables_across_processes() -> None:
    """Turn jax's persistent compilation cache off in this process (a CPU learner host).

    With jax 0.12.1 on CPU, a program whose collectives span processes (gloo) hangs in its
    first collective when it was loaded from the persistent compilation cache
    (``JAX_COMPILATION_CACHE_DIR``) rather than compiled: every host waits in gloo's
    ``waitRecv`` for ever (py-spy / gdb: ``GlooCommunicator::AllReduce``); jax 0.10.2 ran
    the same loaded program. Reproduced by 2 processes x 2 CPU devices jitting one sharded
    sum twice as two function objects (the second compile is a cache hit and hangs;
    tests/e2e/test_multihost_cache.py). The likely cause is the one of
    :func:`same_program_on_every_host`: jax's cache key leaves the source locations out,
    so a loaded executable carries the metadata of the compile that wrote it, and the
    hosts' programs then differ in it; with locations off the same job ran with the cache
    on (one try, 2026-12-08), but the cache stays off until that is confirmed. Compiling
    every program costs the CPU stand-in seconds; TPU and GPU hosts keep the cache.
    """
    jax.config.update("jax_enable_compilation_cache", False)


def wait_for_coordinator(address: str, timeout_s: float, *, process_id: int,
                         poll_s: float = 0.25) -> float:
    """Retry a TCP connect to ``address`` until it succeeds or ``timeout_s`` passes.

    Host 0 may start after the others, so a refused connection is retried.

    Returns: seconds waited.

    Raises:
      CoordinatorUnreachable: naming ``learner host <process_id>``, the address, the timeout
        and the last socket error.
    """
    host, _, port = address.rpartition(":")
    t0 = time.monotonic()
    last: Optional[OSError] = None
    while True:
        left = timeout_s - (time.monotonic() - t0)
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(left, 5.0))):
                return time.monotonic() - t0
        except OSError as e:
            last = e
        if time.monotonic() - t0 + poll_s > timeout_s:
            raise CoordinatorUnreachable(
                f"learner host {process_id}: coordinator {address} (learner host 0) not "
                f"reachable within {timeout_s:g} s (last error: {last}); check that host 0 "
                "started, and the address, port and firewall")
        time.sleep(poll_s)


def initialize(cfg: DistributedConfig) -> None:
    """Join this host to the learner program (``jax.distributed.initialize``).

    Hosts other than 0 first wait for the coordinator's port (:func:`wait_for_coordinator`).

    Raises:
      CoordinatorUnreachable: the coordinator did not accept a connection in time.
      DistributedError: after joining, the process count differs from the config.
    """
    if cfg.process_id != 0:
        wait_for_coordinator(cfg.coordinator_address, cfg.init_timeout_s,
                             process_id=cfg.process_id)
    use_gloo_collectives()
    same_program_on_every_host()
    jax.distributed.initialize(coordinator_address=cfg.coordinator_address,
                               num_processes=cfg.num_processes, process_id=cfg.process_id,
                               initialization_timeout=int(math.ceil(cfg.init_timeout_s)),
                               heartbeat_timeout_seconds=int(math.ceil(cfg.heartbeat_timeout_s)))
    if jax.default_backend() == "cpu":
        no_cached_executables_across_processes()
    if jax.process_count() != cfg.num_processes:
        raise DistributedError(f"learner host {cfg.process_id}: joined {jax.process_count()} "
                               f"processes, expected num_processes = {cfg.num_processes}")


def global_mesh(mesh_cfg):
    """The learner mesh over every host's devices (``jax.devices()`` is global after
    :func:`initialize`); hosts' devices are contiguous, so each host holds a contiguous block
    of batch rows.

    Raises: ValueError: ``data * fsdp * expert * tensor * sequence`` differs from the global device count (names
    the hosts and devices per host).
    """
    devices = jax.devices()
    if mesh_cfg.num_devices != len(devices):
        raise ValueError(
            f"learner.mesh {mesh_cfg.describe()} = {mesh_cfg.num_devices} devices, but the "
            f"learner slice has "
            f"{jax.process_count()} hosts x {jax.local_device_count()} devices = {len(devices)}")
    return make_mesh(mesh_cfg, devices)


# -- batch distribution ------------------------------------------------------------------------

_MSG = 480          # bytes of an error message carried in the header
_FIELDS = tuple(f for f in TrainBatch._fields if f != "routing_ids")   # the [B, L] ones


def _header(rows: int, seq: int, error: str = "") -> np.ndarray:
    msg = np.frombuffer(error.encode()[:_MSG].ljust(_MSG, b"\0"), np.uint8).astype(np.int32)
    return np.concatenate([np.array([rows, seq, 1 if error else 0], np.int32), msg])


def _pack(batch: TrainBatch) -> np.ndarray:
    """``[F, B, L]`` (F = the TrainBatch fields) int32: int and bool fields as values, float32 fields as their bits (the
    broadcast is a sum with zeros, exact on int32 bits; on floats it would turn -0.0 into 0.0);
    a MoE batch's ``routing_ids`` ``[B, L, layers, k]`` follow as ``layers x k`` more planes."""
    out = []
    batch = with_sequence_ids(batch)
    for name in _FIELDS:
        x = np.asarray(getattr(batch, name))
        out.append(x.view(np.int32) if x.dtype == np.float32 else x.astype(np.int32))
    if batch.routing_ids is not None:
        ids = np.asarray(batch.routing_ids, np.int32)
        out.extend(ids.reshape(ids.shape[:2] + (-1,)).transpose(2, 0, 1))
    return np.stack(out)


_DTYPES = dict(tokens=np.int32, attention_mask=np.bool_, positions=np.int32, targets=np.int32,
               loss_mask=np.bool_, behaviour_logprobs=np.float32, advantages=np.float32,
               token_rewards=np.float32, segment_ids=np.int32, prefix_ids=np.int32,
               group_ids=np.int32, policy_lag=np.int32)


def _unpack(packed: np.ndarray, routing=None) -> TrainBatch:
    fields = {}
    for name, x in zip(_FIELDS, packed):
        dt = _DTYPES[name]
        fields[name] = x.view(np.float32) if dt == np.float32 else x.astype(dt)
    if routing is not None:                 # (layers, k, dtype): the planes after the fields
        layers, k, dtype = routing
        planes = packed[len(_FIELDS):]
        fields["routing_ids"] = planes.transpose(1, 2, 0).reshape(
            planes.shape[1:] + (layers, k)).astype(dtype)
    return TrainBatch(**fields)


def local_rows(sharding, global_shape) -> slice:
    """The contiguous rows of a ``[B, L]`` array that this process's devices hold.

    Raises: ValueError: they are not contiguous (a mesh whose device order interleaves hosts).
    """
    idx = sharding.addressable_devices_indices_map(tuple(global_shape)).values()
    spans = sorted({(s[0].start or 0, global_shape[0] if s[0].stop is None else s[0].stop)
                    for s in idx})
    lo, hi = spans[0][0], max(stop for _, stop in spans)
    covered = np.zeros(global_shape[0], bool)
    for a, b in spans:
        covered[a:b] = True
    if not covered[lo:hi].all():
        raise ValueError(f"process {jax.process_index()} holds non-contiguous batch rows {spans}")
    return slice(lo, hi)


def distribute_batch(batch: Optional[TrainBatch], mesh, *, source: int = 0,
                     check=None, routing=None) -> tuple[TrainBatch, dict]:
    """Host ``source``'s host batch -> global batch arrays in ``batch_sharding(mesh)``.

    Every process calls it; only ``source`` passes a batch (the others None). ``source``
    first broadcasts a header (shape, or the error ``check(batch)`` raised there: then every
    host raises it, none is left waiting in a collective), then the batch packed as one int32
    ``[F, B, L]`` (F = the TrainBatch fields) buffer; each host keeps its own rows (:func:`local_rows`) and assembles the
    global arrays with ``jax.make_array_from_process_local_data``. ``routing``: a
    mixture-of-experts learner's ``(layers, k, dtype)``
    (:attr:`rlflow.learner.trainer.Learner.routing`): the checked batch's ``routing_ids``
    travel as ``layers x k`` more planes.

    Returns:
      ``(TrainBatch of jax.Array [B, L], info)``; info: ``batch/broadcast_bytes`` (bytes
      of the broadcast batch buffer, = what each host receives), ``batch/local_bytes`` (bytes
      this host keeps), ``batch/rows`` / ``batch/seq`` (the global batch's ``[B, L]``, packed
      rows when the learner packs), ``batch/distribute_s`` (seconds).

    Raises:
      BatchError: ``check`` rejected the batch on host ``source`` (raised on every host, with
        the source host's message).
    """
    t0 = time.perf_counter()
    is_source = jax.process_index() == source
    if is_source:
        if batch is None:
            raise ValueError(f"learner host {source} must pass the step's batch")
        error = ""
        try:
            if check is not None:
                batch = check(batch)
            shape = np.shape(batch.tokens)
        except (BatchError, TokenRangeError, RuntimeError) as e:
            error, shape = f"{type(e).__name__}: {e}", (0, 0)
        header = _header(*shape, error=error)
    else:
        header = _header(0, 0)
    header = np.asarray(multihost_utils.broadcast_one_to_all(header, is_source=is_source))
    if header[2]:
        msg = bytes(header[3:].astype(np.uint8)).rstrip(b"\0").decode(errors="replace")
        raise BatchError(f"learner host {source} rejected the step's batch: {msg}")
    rows, seq = int(header[0]), int(header[1])
    planes = len(_FIELDS) + (0 if routing is None else routing[0] * routing[1])
    packed = _pack(batch) if is_source else np.zeros((planes, rows, seq), np.int32)
    packed = np.asarray(multihost_utils.broadcast_one_to_all(packed, is_source=is_source))
    host = _unpack(packed, routing)
    sh = batch_sharding(mesh)
    mine = local_rows(sh, (rows, seq))
    out = TrainBatch(*(None if x is None else jax.make_array_from_process_local_data(
        sh, x[mine], (rows, seq) + x.shape[2:]) for x in host))
    local = sum(x[mine].nbytes for x in host if x is not None)
    return out, {"batch/broadcast_bytes": float(packed.nbytes), "batch/local_bytes": float(local),
                 "batch/rows": float(rows), "batch/seq": float(seq),
                 "batch/distribute_s": time.perf_counter() - t0}


def train_step(learner, batch: Optional[TrainBatch], *, source: int = 0
               ) -> tuple[dict[str, float], dict]:
    """One optimiser step of a multi-host :class:`rlflow.learner.trainer.Learner` (built on
    :func:`global_mesh`); every host calls it, host ``source`` with the batch.

    Returns: ``(step metrics as floats, distribution info)`` on every host.

    Raises: BatchError on every host when host ``source`` rejects the batch (as
    :meth:`Learner.step`).
    """
    pending, info = dispatch_step(learner, batch, source=source)
    return pull_metrics(pending), info


def dispatch_step(learner, batch: Optional[TrainBatch], *, source: int = 0,
                  checked: bool = False) -> tuple[dict, dict]:
    """:func:`train_step` without waiting for the step: returns ``(step metrics as device
    arrays, distribution info)`` once the batch is distributed and the step dispatched
    (``pull_metrics`` waits for the metrics). ``checked``: host ``source``'s batch is
    already ``learner.check_batch``'s output (not checked again).

    Raises: as :func:`train_step`.
    """
    dev, info = distribute_batch(batch, learner.mesh, source=source,
                                 check=None if checked else learner.check_batch,
                                 routing=learner.routing)
    return learner.dispatch_on_device(dev), info


def gather_to_host(tree):
    """Every leaf of ``tree`` (global arrays, any sharding) as a full numpy array on every host
    (a collective: every process must call it)."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)
    return jax.tree.map(one, tree)
