"""What each program's process holds on the CPU backend: its device terms plus what lives
beside them in the process (``python -m rlflow.console.fit`` prints these terms).

:func:`rlflow.learner.memory.learner_memory` and :func:`rlflow.console.fit.sampler_bytes`
count the arrays on a program's devices. On the CPU backend those devices are the process's
own host memory, and the process holds more (bytes):

learner process (:func:`learner_process`):

* ``runtime``: :data:`LEARNER_RUNTIME_BYTES`, a learner process whose model is negligible:
  the Python interpreter, jax and XLA's CPU client, the program's imports (orbax, optax,
  grain, ...), the tokenizer and the compiler's working memory;
* ``device``: the learner's per-device terms (params, optimizer, grads, reference,
  published, activations) x ``learner.num_devices`` (every fake CPU device is this
  process's memory);
* ``load``: one host copy of the weights in the parameter dtype, with ``model.path`` and
  ``runtime.keep_freed_host_memory`` (glibc never returns freed heap,
  :mod:`rlflow.system.host_memory`): :func:`rlflow.models.hf.load_hf` reads each
  parameter into numpy before placing it, and the heap keeps those pages. Measured, the
  learner holds 0.3-0.85 GiB above ``runtime`` + ``device`` for SmolLM2-135M (0.5 GiB of
  float32 weights); a ``malloc_trim`` right after start-up did not lower its peak (4.87
  GiB against 4.75-5.30 without), so this term stands for host memory the steps use as
  well (the weight server's and the batches' host buffers), not for the loader's pages
  alone. 0 for a random model (initialised on the device) or with the setting off;

sampler replica process (:func:`sampler_process`):

* ``runtime``: :data:`SAMPLER_RUNTIME_BYTES`, the same for a sampler;
* ``weights``: the engine's copy (:func:`rlflow.console.fit.sampler_weight_bytes`);
* ``swap``: the next version while it is laid out beside the serving one: the pulled
  version in the published dtype, plus the per-layer slices of its stacked layers in the
  sampler dtype (:mod:`rlflow.sampler.layer_storage`; freed one by one as they are
  transposed, :mod:`rlflow.sampler.kernel_layout`);
* ``evaluation``: with ``eval.every_steps > 0``, a version pulled while an evaluation
  decodes is held back until it ends (:class:`rlflow.sampler.program.SamplerProgram`): one
  more copy in the published dtype;
* ``kv_cache``: :func:`rlflow.console.checks.kv_cache_bytes`;
* ``decode``: a decode call's float32 logits over the vocabulary for every slot, the
  sampling's probabilities and their sorted copy (top-k / top-p): ``3 x 4 x slots x V``;

reward workers: :data:`REWARD_WORKER_BYTES` each (``reward.num_workers``, and as many for
the evaluation's own rewarder with ``eval.every_steps > 0``,
:func:`rlflow.config.eval.eval_reward_config`).

Measured (2026-12-07, this repository's CPU test machine: 2 cores, 23.5 GiB, Python 3.11,
jax CPU, shared by other jobs; ``VmHWM`` of ``/proc/<pid>/status`` sampled every 2 s),
SmolLM2-135M (``configs/smollm2_arith.py``, 2 steps, the evaluation at version 0): this
model says learner 4.95 GiB, sampler 2.60 GiB; the runs peaked at learner 4.75-5.30 GiB
(three runs of the same code) and sampler 2.30 GiB (3.74 GiB before the sampler kept one
copy of the weights and gave freed pages back, :mod:`rlflow.sampler.layer_storage`,
:func:`rlflow.system.host_memory.release_freed_memory`).

Left out: the compiled programs' code (XLA reports 0.0 MiB of code for the learner's step
on CPU); a second packed shape's temporaries beyond the first's (the step's activations
are counted once: at most two packed shapes a run, ``rlflow.learner.packing``, one
executing at a time); the orbax checkpoint's host copies while saving; the start-up peak
of a sampler reading its weights from disk (the file's mapped pages plus the arrays, about
twice the weights, before any version is pulled: below the steady figure); the heap the
allocator keeps after frees beyond the ``load`` term; the learner's growth over a longer
run (issue 49: 5.8 GiB after 5 steps, 8.7 GB at step 24 of the README's run; not measured
here, where runs were 2 steps). Those are what :data:`rlflow.console.fit.HEADROOM` leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlflow.learner.memory import GIB, Architecture, learner_memory

#: A learner process whose model is negligible (bytes): ``import jax``, the CPU client,
#: the program's imports, the compilation of its train steps (XLA's compiler works in this
#: process's heap, which the learner keeps: ``runtime.keep_freed_host_memory``), the prompt
#: pipeline, checkpointing, metrics and the weight server. Measured 2026-12-08 on the 2-core
#: CPU test machine (Python 3.12, jax 0.12.1 CPU): the demo config's learner (a
#: 0.1M-parameter model) peaked (``VmHWM``) over a 2-step run with an evaluation at 0.53 GiB
#: when it compiled its programs and 0.35 GiB when it loaded them from a persistent
#: compilation cache (``tests/e2e/test_process_memory.py`` measures it again; 0.79 GiB on
#: Python 3.11 before tensorboardX was imported with torch hidden:
#: :func:`rlflow.run.metrics.summary_writer_class`).
LEARNER_RUNTIME_BYTES = 0.45 * GIB

#: The same for a sampler replica's process (its imports; its engine's compiled prefill,
#: insert and decode programs; its reward and evaluation clients): the demo config's
#: sampler peaked at 0.37 GiB (compiling) and 0.28 GiB (from the cache) in the same runs.
SAMPLER_RUNTIME_BYTES = 0.33 * GIB

#: One reward worker process (a spawned Python with the reward functions imported):
#: measured 74 MiB each (``VmHWM``, ``math_verify``), 2026-12-07, same machine.
REWARD_WORKER_BYTES = 80 * 2 ** 20

_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class ProcessMemory:
    """Bytes of each term of one process (module doc), in order, and their total."""
    name: str
    terms: tuple            # ((term, bytes), ...)

    @property
    def total(self) -> float:
        return float(sum(b for _, b in self.terms))

    def term(self, name: str) -> float:
        return dict(self.terms)[name]

    def describe(self) -> str:
        return (f"{self.name} " + ", ".join(f"{t} {b / GIB:.2f}" for t, b in self.terms) +
                f" = {self.total / GIB:.2f} GiB")


def learner_process(cfg, arch: Architecture) -> ProcessMemory:
    """The learner program's process on the CPU backend (module doc)."""
    mem = learner_memory(arch, cfg)
    load = 0.0
    if cfg.model.path and cfg.runtime.keep_freed_host_memory:
        load = arch.num_params() * _BYTES[cfg.model.param_dtype]
    return ProcessMemory("learner", (("runtime", LEARNER_RUNTIME_BYTES),
                                     ("device", mem.total * cfg.learner.num_devices),
                                     ("load", load)))


def sampler_process(cfg, arch: Architecture) -> ProcessMemory:
    """One sampler replica's process on the CPU backend (module doc)."""
    from rlflow.sampler.memory import kv_cache_bytes, sampler_bytes, sampler_weight_bytes

    sp = cfg.sampler
    per = _BYTES[sp.dtype or cfg.model.dtype]
    kv = kv_cache_bytes(cfg, arch)
    weights = sampler_bytes(cfg, arch, accelerator=False) - kv
    published = sampler_weight_bytes(arch, _BYTES[cfg.published_dtype])
    outside_layers = arch.vocab_size * arch.hidden_size * (
        1 if arch.tie_word_embeddings else 2) + arch.hidden_size
    slices = (arch.num_params() - outside_layers) * per
    held = published if cfg.eval.enabled else 0.0
    decode = 3 * 4 * sp.num_slots * arch.vocab_size
    return ProcessMemory("sampler", (("runtime", SAMPLER_RUNTIME_BYTES), ("weights", weights),
                                     ("swap", published + slices), ("evaluation", held),
                                     ("kv_cache", float(kv)), ("decode", float(decode))))


def reward_workers_bytes(cfg) -> float:
    """The reward worker processes of one sampler replica (module doc)."""
    n = cfg.reward.num_workers * (2 if cfg.eval.enabled else 1)
    return n * REWARD_WORKER_BYTES
