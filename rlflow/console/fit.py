"""Does a run fit its devices' memory? Checked before any program starts.

``rlflow train`` (:func:`rlflow.console.checks.check_runnable`) and the TPU scripts' slice
check (:mod:`rlflow.console.slices`) call :func:`check_memory`, which compares, per device:

* the learner: parameters, AdamW moments, gradients, the KL reference, the published
  version and one micro-batch's activations with the config's ``learner.remat``,
  ``learner.attention``, ``learner.logprob_chunk`` and row length
  (:func:`rlflow.learner.memory.learner_memory`);
* a sampler replica: its weights in the sampler's dtype, int8 projection kernels and their
  scales with ``sampler.quantization="int8"`` on an accelerator (split over the ``tensor``
  axis, one copy per ``data`` replica) and its KV cache
  (:func:`rlflow.sampler.memory.sampler_bytes`), spread over its devices;

against :data:`HEADROOM` of the device's memory: an accelerator's HBM per chip
(:data:`DEVICE_MEMORY`, by the TPU type the scripts were given or ``TPU_ACCELERATOR_TYPE``
on a TPU VM), or on the CPU backend (``rlflow train`` on one machine: every program's fake
devices share the host) this machine's memory (the smaller of its RAM and its cgroup's
limit) against what every program's process holds together: the learner's and each
sampler replica's device terms plus their processes' runtime, host copies of weights,
weight swaps, held evaluation versions and decode buffers, and the reward worker
processes (:mod:`rlflow.console.process_memory`, which says what is left out). A run that does
not fit is refused with a :class:`MemoryDoesNotFit` (a ``ConfigError``) that prints every
term and names the setting to change (``learner.micro_batches`` with the count that fits,
``learner.remat``, ``learner.attention``, ``learner.logprob_chunk``, ``sampler.max_tokens``,
``sampler.num_slots``, ``learner.mesh`` / the slice). ``runtime.check_memory=False`` skips
it: the learner's activations are an estimate (within 1% of XLA's compiled temporaries of
the grad step at 2K-32K tokens a row on CPU, ``benchmarks/long_context.py``; on an
accelerator a backend's own buffers and the compiler's memory are what :data:`HEADROOM`
leaves).

:func:`smallest_slice` picks the smallest TPU slice of a generation on which a learner fits
(the learner given every chip of the slice as ``fsdp``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from rlflow.config import ConfigError
from rlflow.console.hf_sizes import hf_architecture
from rlflow.learner.memory import GIB, Architecture, LearnerMemory, learner_memory
from rlflow.sampler.memory import sampler_bytes

#: The share of a device's memory a run may plan to use (XLA's own buffers, fragmentation,
#: the runtime and, on the CPU backend, the Python processes take the rest).
HEADROOM = 0.9

#: HBM bytes per chip, matched against ``jax.Device.device_kind`` (lower-cased substring,
#: first match wins, as :data:`rlflow.run.perf.PEAK_FLOPS`); Cloud TPU's and NVIDIA's
#: published figures.
DEVICE_MEMORY: tuple[tuple[str, float], ...] = (
    ("v6 lite", 32e9),        # TPU v6e (Trillium): 32 GB
    ("v6e", 32e9),
    ("v5 lite", 16e9),        # TPU v5e: 16 GB
    ("v5e", 16e9),
    ("v5p", 95e9),            # TPU v5p: 95 GB
    ("v5", 95e9),
    ("v4", 32 * GIB),         # TPU v4: 32 GiB
    ("h200", 141e9),          # NVIDIA H200: 141 GB
    ("h100", 80e9),           # NVIDIA H100: 80 GB
)

#: Cloud TPU accelerator type prefix (``v6e-64``) -> its chips' ``device_kind`` key above.
TPU_GENERATIONS = {"v4": "v4", "v5p": "v5p", "v5litepod": "v5 lite", "v6e": "v6 lite"}
#: The sizes (the number after the dash) Cloud TPU offers, smallest first.
TPU_SIZES = {"v4": (8, 16, 32, 64, 128, 256, 512, 1024),
             "v5p": (8, 16, 32, 64, 128, 256, 512, 1024),
             "v5litepod": (1, 4, 8, 16, 32, 64, 128, 256),
             "v6e": (1, 4, 8, 16, 32, 64, 128, 256)}


class MemoryDoesNotFit(ConfigError):
    """A program's per-device memory exceeds :data:`HEADROOM` of its device; the message
    starts with the setting to change and gives every term in GiB."""


def _size(b: float) -> str:
    """``"23.5 GiB"``, or MiB below a tenth of a GiB."""
    return f"{b / GIB:.1f} GiB" if b >= 0.1 * GIB else f"{b / 2 ** 20:.1f} MiB"


def device_memory(kind: str) -> Optional[float]:
    """Bytes of memory of one device named ``kind`` (a ``device_kind`` or a TPU type such as
    ``v6e-64``), or None when :data:`DEVICE_MEMORY` does not know it."""
    kind = kind.lower()
    generation = kind.rsplit("-", 1)[0]
    kind = TPU_GENERATIONS.get(generation, kind)
    return next((b for key, b in DEVICE_MEMORY if key in kind), None)


def chip_name(tpu_type: str) -> str:
    """``"a v6e-64 chip (29.8 GiB)"``: how messages name a slice's device."""
    return f"a {tpu_type} chip ({_size(device_memory(tpu_type))})"


def slice_shape(tpu_type: str) -> tuple[int, int]:
    """``(hosts, chips per host)`` of a Cloud TPU type, as ``slice_shape`` of
    ``scripts/tpu/common.sh``: v4 / v5p count TensorCores (2 a chip, 4 chips a host);
    v5litepod / v6e count chips (up to 8 on one host, else 4 a host).

    Raises:
      ValueError: an unknown generation or a size Cloud TPU does not offer.
    """
    generation, _, size = tpu_type.rpartition("-")
    if generation not in TPU_SIZES or not size.isdigit() or int(size) not in TPU_SIZES[generation]:
        raise ValueError(f"unknown TPU type {tpu_type!r}: expected one of "
                         f"{', '.join(f'{g}-N' for g in TPU_SIZES)} with N in its sizes")
    n = int(size)
    if generation in ("v4", "v5p"):
        return n // 8, 4
    return (1, n) if n <= 8 else (n // 4, 4)


def device_count(tpu_type: str) -> int:
    """Chips (JAX devices) of a Cloud TPU type: hosts x chips per host."""
    hosts, chips = slice_shape(tpu_type)
    return hosts * chips


def architecture(cfg) -> Optional[Architecture]:
    """The policy's sizes: ``model.path``'s config.json (no weight is read), else the
    config's random-model fields. When the folder's config.json does not give them (the TPU
    scripts load a config against a stand-in folder: the model lives on the hosts), the
    config's model fields when it sets them (not :class:`rlflow.config.ModelConfig`'s
    defaults), else None: the sizes are unknown here."""
    from rlflow.config import ModelConfig

    m = cfg.model
    if m.path:
        found = hf_architecture(m.path)
        if found is not None:
            return found
        default = ModelConfig()
        if all(getattr(m, f) == getattr(default, f) for f in _SIZE_FIELDS):
            return None
    return Architecture.from_model_config(m)


_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim")


def host_memory_bytes(cgroup_root: str = "/sys/fs/cgroup") -> Optional[float]:
    """This machine's memory for the CPU backend: its RAM, or its cgroup's memory limit
    when smaller (cgroup v2 ``memory.max``, v1 ``memory/memory.limit_in_bytes``); None when
    unknown."""
    from rlflow.system.oom import machine_memory_bytes

    ram = machine_memory_bytes()
    if ram is None:
        return None
    ram = float(ram)
    for path in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            with open(os.path.join(cgroup_root, path)) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            ram = min(ram, float(text))
    return ram


@dataclass(frozen=True)
class Fit:
    """What :func:`memory_fit` found: the learner's per-device terms, a sampler replica's
    bytes, what they are held against (``capacity`` bytes of ``where``) and whether each
    fits."""
    learner: LearnerMemory
    sampler: float
    capacity: float
    where: str
    learner_need: float
    sampler_need: float
    sampler_capacity: float
    sampler_where: str
    shared: bool = False      # the CPU backend: one machine's memory for every program
    processes: tuple = ()     # the CPU backend: ProcessMemory of the learner and a replica
    reward_workers: float = 0.0     # the CPU backend: one replica's reward worker processes

    @property
    def learner_fits(self) -> bool:
        return self.learner_need <= HEADROOM * self.capacity

    @property
    def sampler_fits(self) -> bool:
        return self.sampler_need <= HEADROOM * self.sampler_capacity

    def describe(self) -> str:
        if self.shared:
            procs = "; ".join(p.describe() for p in self.processes)
            return (f"learner per device: {self.learner.describe()}; sampler replica "
                    f"{_size(self.sampler)}; processes: {procs}; reward workers "
                    f"{_size(self.reward_workers)} a replica; in all "
                    f"{_size(self.learner_need)} of {self.where}")
        return (f"learner per device: {self.learner.describe()} of {self.where}; sampler "
                f"replica {_size(self.sampler)}, {_size(self.sampler_need)} a device of "
                f"{self.sampler_where}")


def memory_fit(cfg, arch: Architecture, device_bytes: Optional[float] = None,
               where: str = "", sampler_device_bytes: Optional[float] = None,
               sampler_where: str = "") -> Fit:
    """Per-device needs of ``cfg`` for ``arch`` against ``device_bytes`` (an accelerator's
    memory per chip; the sampler's ``sampler_device_bytes``, default the same); None: the
    CPU backend, every program of the run on this machine (:func:`host_memory_bytes`), the
    learner and sampler totals together."""
    mem = learner_memory(arch, cfg)
    sp = cfg.sampler
    sampler = sampler_bytes(cfg, arch, accelerator=device_bytes is not None)
    if device_bytes is not None:
        where = where or f"{_size(device_bytes)} a chip"
        if sampler_device_bytes is None:
            sampler_device_bytes, sampler_where = device_bytes, where
        return Fit(mem, sampler, device_bytes, where, mem.total, sampler / sp.num_devices,
                   sampler_device_bytes,
                   sampler_where or f"{_size(sampler_device_bytes)} a chip")
    from rlflow.console.process_memory import (learner_process, reward_workers_bytes,
                                               sampler_process)

    host = host_memory_bytes()
    learner_proc, sampler_proc = learner_process(cfg, arch), sampler_process(cfg, arch)
    workers = reward_workers_bytes(cfg)
    both = learner_proc.total + (sampler_proc.total + workers) * sp.num_replicas
    where = where or (f"this machine's {_size(host or 0)} (the CPU backend: the learner's "
                      f"{cfg.learner.num_devices} device(s) and {sp.num_replicas} sampler "
                      f"replica(s) share it)")
    return Fit(mem, sampler, host or float("inf"), where, both, both, host or float("inf"),
               where, shared=True, processes=(learner_proc, sampler_proc),
               reward_workers=workers)


def accelerator_memory(env=None) -> tuple[Optional[float], str]:
    """``(bytes a device, what)`` of the backend ``rlflow train`` runs on here:
    ``(None, "")`` for the CPU backend (``JAX_PLATFORMS=cpu``, or no accelerator plugin
    installed), the HBM of ``TPU_ACCELERATOR_TYPE`` on a TPU VM; ``(None, reason)`` where
    an accelerator's memory is unknown here (nothing is checked). No backend is
    initialised (that would take the accelerator from the programs)."""
    import importlib.util

    env = os.environ if env is None else env
    platform = env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if platform == "cpu":
        return None, ""
    tpu_type = env.get("TPU_ACCELERATOR_TYPE", "")
    if platform == "tpu" or tpu_type or importlib.util.find_spec("libtpu") is not None:
        b = device_memory(tpu_type) if tpu_type else None
        return (b, tpu_type) if b else (None, f"a TPU of unknown type "
                                              f"(TPU_ACCELERATOR_TYPE={tpu_type!r})")
    if platform in ("cuda", "gpu") or any(importlib.util.find_spec(p) is not None for p in (
            "jax_cuda12_plugin", "jax_cuda13_plugin")):
        return None, "a GPU (its memory is not in rlflow's table)"
    return None, ""


def check_memory(cfg, *, device_bytes: Optional[float] = None, where: str = "",
                 sampler_device_bytes: Optional[float] = None, sampler_where: str = "",
                 arch: Optional[Architecture] = None) -> Optional[Fit]:
    """Refuse ``cfg`` when a program cannot fit its devices (module doc); returns the
    :class:`Fit` (None when skipped: ``runtime.check_memory=False``, unknown model sizes,
    or an accelerator whose memory is unknown).

    Args:
      device_bytes / where: an accelerator's memory per chip and its name (the TPU
        scripts: the learner slice's type); None: :func:`accelerator_memory` of this
        machine. sampler_device_bytes / sampler_where: the sampler's (default the same).
      arch: the model's sizes (default :func:`architecture`).

    Raises:
      MemoryDoesNotFit: naming the setting to change, with every term.
    """
    if not cfg.runtime.check_memory:
        return None
    arch = arch or architecture(cfg)
    if arch is None:
        return None
    if device_bytes is None:
        device_bytes, where = accelerator_memory()
        if device_bytes is None and where:
            return None
    fit = memory_fit(cfg, arch, device_bytes, where, sampler_device_bytes, sampler_where)
    if not fit.learner_fits:
        raise MemoryDoesNotFit(_learner_advice(cfg, arch, fit, device_bytes))
    if not fit.sampler_fits:
        sp = cfg.sampler
        raise MemoryDoesNotFit(
            f"sampler.max_tokens: a sampler replica needs {_size(fit.sampler)} "
            f"(weights x sampler.mesh.data={sp.mesh.data} and the KV cache of "
            f"sampler.num_slots={sp.num_slots} x (max_prefill_length {sp.max_prefill_length} "
            f"+ max_tokens {sp.max_tokens}) positions) over {sp.num_devices} device(s), "
            f"{_size(fit.sampler_need)} a device, more than {HEADROOM:.0%} of "
            f"{fit.sampler_where}; lower sampler.max_tokens "
            f"or sampler.num_slots, or give the sampler more devices (sampler.mesh.tensor"
            f"{', sampler.mesh.expert' if arch.num_experts else ''}), "
            f"or skip this check with --runtime.check-memory false")
    return fit


def _learner_advice(cfg, arch: Architecture, fit: Fit, device_bytes) -> str:
    """The refusal of a learner that does not fit: the setting first, then the terms."""
    lr, sp = cfg.learner, cfg.sampler
    m = lr.mesh
    rows = lr.groups_per_step * sp.group_size / lr.micro_batches / m.batch_shards
    seq = max(lr.seq_buckets) if lr.seq_buckets else sp.max_prefill_length + sp.max_tokens
    shape = (f"{rows:g} row(s) of {seq} tokens per device per micro-batch, learner.remat="
             f"{lr.remat!r}, learner.attention={lr.attention!r}, learner.logprob_chunk="
             f"{lr.logprob_chunk}")
    per = f"{_size(fit.learner.total)} per device ({fit.learner.describe()}; {shape})"
    if device_bytes:
        head = f"the learner needs {per}, more than {HEADROOM:.0%} of {fit.where}"
    else:
        procs = "; ".join(p.describe() for p in fit.processes)
        head = (f"the learner needs {per} x {lr.num_devices} device(s); with "
                f"{sp.num_replicas} sampler replica(s) of {_size(fit.sampler)} and what the "
                f"processes hold ({procs}; reward workers {_size(fit.reward_workers)} a "
                f"replica) that is {_size(fit.learner_need)} on this machine, more than "
                f"{HEADROOM:.0%} of {fit.where}")
    state = fit.learner.total - fit.learner.activations
    micro = _micro_batches_that_fit(cfg, arch, device_bytes, fit)
    if micro is not None:
        return (f"learner.micro_batches: {head}; set --learner.micro-batches {micro} (fewer "
                f"rows per micro-batch, the same step)")
    if lr.remat != "full":
        return f"learner.remat: {head}; set --learner.remat full (recompute each layer)"
    if lr.attention == "xla":
        return (f"learner.attention: {head}; set --learner.attention auto (never holds the "
                f"[T, T] scores)")
    if lr.logprob_chunk == 0:
        return f"learner.logprob_chunk: {head}; set --learner.logprob-chunk 1024"
    if fit.learner.activations > state:
        return (f"sampler.max_tokens: {head}; one row of {seq} tokens does not fit: shorten "
                f"the rows (sampler.max_tokens, sampler.max_prefill_length, "
                f"learner.seq_buckets) or split them over more devices")
    axes = "learner.mesh.fsdp, learner.mesh.expert" if arch.num_experts else "learner.mesh.fsdp"
    return (f"learner.mesh: {head}; the parameters and optimizer state need more devices "
            f"({axes}, a larger slice){'' if device_bytes else ' or a machine with more memory'}"
            f", or skip this check with --runtime.check-memory false")


def _micro_batches_that_fit(cfg, arch, device_bytes, fit) -> Optional[int]:
    """The smallest ``learner.micro_batches`` above the config's (dividing the step's rows
    per device) with which the learner fits, or None."""
    lr, sp = cfg.learner, cfg.sampler
    samples = lr.groups_per_step * sp.group_size
    shards = lr.mesh.batch_shards
    for k in range(lr.micro_batches + 1, samples // shards + 1):
        if samples % (k * shards):
            continue
        trial = dataclasses.replace(cfg, learner=dataclasses.replace(lr, micro_batches=k))
        if memory_fit(trial, arch, device_bytes, fit.where).learner_fits:
            return k
    return None


def fit_to_slice(cfg, tpu_type: str):
    """``cfg`` with its learner on every chip of ``tpu_type``: ``learner.num_devices`` = the
    slice's chips, ``num_hosts`` its hosts, mesh ``fsdp`` = chips / the config's other
    model axes (``tensor``, ``expert``, and ``sequence`` where the mesh has one; ``data``
    1), and ``micro_batches`` keeping the config's rows per device per micro-batch (at least
    one row; the batch is split over ``fsdp x expert``). None when the step's samples do
    not split that way."""
    hosts, chips = slice_shape(tpu_type)[0], device_count(tpu_type)
    lr, sp = cfg.learner, cfg.sampler
    m = lr.mesh
    expert = getattr(m, "expert", 1)
    other = m.tensor * getattr(m, "sequence", 1) * expert
    if chips % other:
        return None
    fsdp = chips // other
    rows = max(1, lr.groups_per_step * sp.group_size // (lr.micro_batches * m.batch_shards))
    samples = lr.groups_per_step * sp.group_size
    if samples % (fsdp * expert * rows):
        return None
    mesh = dataclasses.replace(m, data=1, fsdp=fsdp)
    return dataclasses.replace(cfg, learner=dataclasses.replace(
        lr, num_devices=chips, num_hosts=hosts, mesh=mesh,
        micro_batches=samples // (fsdp * expert * rows)))


def smallest_slice(cfg, arch: Architecture, generations: Sequence[str] = ("v5p", "v6e")
                   ) -> list[tuple[str, Optional[Fit]]]:
    """For each TPU generation, ``(type, fit)`` of the smallest slice on which ``cfg``'s
    learner (:func:`fit_to_slice`) fits a chip's HBM; ``(generation, None)`` when none of
    :data:`TPU_SIZES` does."""
    out = []
    for generation in generations:
        found: tuple[str, Optional[Fit]] = (generation, None)
        for size in TPU_SIZES[generation]:
            tpu_type = f"{generation}-{size}"
            trial = fit_to_slice(cfg, tpu_type)
            if trial is None:
                continue
            fit = memory_fit(trial, arch, device_memory(tpu_type), chip_name(tpu_type))
            if fit.learner_fits:
                found = (tpu_type, fit)
                break
        out.append(found)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m rlflow.console.fit --config PATH [--tpu v5p,v6e] [-- overrides]``: print
    the memory the run needs per device; with ``--tpu``, the smallest slice of each
    generation its learner fits (:func:`smallest_slice`), else the start-up check of this
    machine (:func:`check_memory`). Exit 0 when it fits, 2 when not (the refusal printed)."""
    import argparse
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: list[str] = []
    if "--" in argv:
        argv, overrides = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    p = argparse.ArgumentParser(prog="python -m rlflow.console.fit")
    p.add_argument("--config", required=True)
    p.add_argument("--tpu", default="", help="TPU generations, comma-separated (v5p,v6e)")
    args = p.parse_args(argv)
    from rlflow.console.config_args import parse_train_args

    try:
        cfg = parse_train_args(["--config", args.config, *overrides])
        arch = architecture(cfg)
        if arch is None:
            raise ConfigError(f"model.path: no config.json with the model's sizes in "
                              f"{cfg.model.path!r}")
        if not args.tpu:
            fit = check_memory(dataclasses.replace(cfg, runtime=dataclasses.replace(
                cfg.runtime, check_memory=True)), arch=arch)
            print(f"fits: {fit.describe()}" if fit else "not checked: the accelerator's "
                  "memory is unknown here")
            return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lr, sp = cfg.learner, cfg.sampler
    seq = max(lr.seq_buckets) if lr.seq_buckets else sp.max_prefill_length + sp.max_tokens
    print(f"{cfg.name}: {arch.num_params() / 1e9:.2f}B parameters, rows of {seq} tokens, "
          f"learner.remat={lr.remat!r}, learner.attention={lr.attention!r}, "
          f"learner.logprob_chunk={lr.logprob_chunk}, compute {lr.compute_dtype}")
    code = 0
    for tpu_type, fit in smallest_slice(cfg, arch, args.tpu.split(",")):
        if fit is None:
            print(f"{tpu_type}: no slice fits")
            code = 2
            continue
        trial = fit_to_slice(cfg, tpu_type)
        m = trial.learner.mesh
        print(f"{tpu_type}: learner mesh fsdp={m.fsdp} x tensor={m.tensor}"
              f"{f' x expert={m.expert}' if m.expert > 1 else ''}, "
              f"micro_batches={trial.learner.micro_batches}; per chip "
              f"{fit.learner.describe()} of {fit.where}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
