"""The sampler program's section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Tuple, get_args

from rlflow.config.validation import DTYPES, _check, _positive, _one_of, _finite_floats
from rlflow.config.model import MeshConfig

# how the engine stores its wide projection kernels (rlflow.sampler.kernel_layout)
KernelLayout = Literal["auto", "in_out", "out_in"]
KERNEL_LAYOUTS = get_args(KernelLayout)
# how the engine stores its projection kernels' values (rlflow.sampler.quantization)
Quantization = Literal["none", "int8"]
QUANTIZATIONS = get_args(Quantization)


@dataclass(frozen=True)
class SamplerConfig:
    """The sampler program: JetStream engine, continuous batching, sampling settings.

    Attributes:
      num_slots: decode slots (the decode batch size).
      max_prefill_length: longest prompt, in tokens.
      prefill_buckets: padded prefill lengths, increasing; the largest equals
        max_prefill_length (one compiled prefill per bucket).
      max_tokens: most new tokens per completion.
      group_size: completions per prompt (G).
      temperature / top_k / top_p: sampling settings (temperature 0 is greedy; top_k 0 off).
      on_long_prompt: "error" or "truncate" (keep the last max_prefill_length tokens, counted).
      num_devices: devices of the sampler program (fake CPU devices on a laptop).
      mesh: the sampler's mesh (tensor parallel axis at least).
      seed: base PRNG seed; the sampler program derives each request's seed from it and
        the request's position in the prompt stream (control.seeds.derive_seed).
      decode_steps_per_call: decode steps per jitted decode call (k >= 1): the k steps run
        in one ``lax.scan`` with stop ids and ``max_tokens`` checked on device, and come back
        in one host copy. Weight swaps and slot refills happen between calls (every token
        is tagged with the version that sampled it), so a slot that finishes mid-call
        idles for the rest of it (about k/2 slot steps per completion). Default 8: per
        benchmarks/sampler_throughput.py the fastest setting (the per-call dispatch and
        host bookkeeping are paid once per 8 tokens) at a small occupancy cost; 1 refills
        every free slot before every step.
      decode_lanes: independent continuous batchers the slots are split into (L >= 1
        dividing num_slots, or 0, see below), each decoding ``num_slots / L`` slots with
        its own jitted calls, all L running at once on L threads (rlflow.sampler.lanes).
        For the CPU backend, where one decode call of a small model runs mostly on one
        core: on 2 cores 2 lanes decode 1.4-1.6x the tokens/s of one at hidden 256, but
        0.65-0.87x at hidden 64 (per-call overhead dominates there;
        benchmarks/sampler_throughput.py). 0 (default): chosen by the sampler program
        (:func:`rlflow.sampler.lanes.lane_count`): 2 on the CPU backend with >= 2 CPUs per
        replica (the CPUs the sampler process may use / num_replicas), hidden_size >= 256,
        an even num_slots >= 4 and single-turn requests; else 1 (TPU/GPU: a device runs one
        program at a time). Multi-turn episodes need 0 or 1.
      max_prefill_batch: most prompts prefilled in one call (C >= 1). A refill prefills
        its new prompts in calls of up to C rows, padded to a power of two, so prefill and
        insert compile at most log2(C) + 1 times per bucket (each compile stalls every
        slot); 1 is JetStream's one prompt per prefill.
      num_replicas: sampler replicas (N >= 1), each an independent sampler program with
        its own process, devices and engine, all leasing prompts from the learner's prompt
        ledger. ``rlflow train`` starts N processes of ``num_devices`` devices each; on
        Cloud TPU each sampler host is one replica (``scripts/tpu --sampler-slices``).
      dtype: the sampler's weights, activations and KV cache, "float32" or "bfloat16";
        None: the model section's ``dtype`` / ``param_dtype``. "bfloat16" beside a float32
        learner is the usual split (verl's vLLM rollouts default to bf16): the learner
        publishes every version rounded once to bf16 (``ExperimentConfig.published_dtype``:
        half the bytes per weight sync, and deltas ~10x smaller than float32 ones), and a
        decode step reads half the bytes (benchmarks/sampler_throughput.py). The behaviour logprobs are then those of
        the rounded policy; with ``learner.off_policy="decoupled"`` (the default) the
        learner recomputes the old policy's logprobs in its own dtype, so the rounding
        enters only the truncated behaviour weight.
      kernel_layout: how the engine stores its wide projection kernels (SwiGLU gate/up,
        an untied LM head; 2-D ``[in, out]`` with in < out): "in_out" as the model holds
        them, "out_in" transposed once per weight version (XLA:CPU's decode-step dots
        ran 1.3-1.6x faster on them, :mod:`rlflow.sampler.kernel_layout`); "auto"
        (default): "out_in" on the CPU backend, "in_out" on TPU/GPU. Same function either
        way (the dots' rounding order may differ).
      kv_cache: how the KV cache is held: "contiguous" (default: every slot reserves
        max_prefill_length + max_tokens positions) or "paged" (pools of pages of page_size
        tokens and a page table per slot, :mod:`rlflow.models.paged_kv_cache`; pages are
        taken as a sequence grows and returned when it ends, a sample is admitted while
        pages are free, and when they run out the latest admitted sequence is preempted
        and resumed later, its tokens, logprobs and versions kept). Same tokens either way;
        with "paged", num_slots (the decode batch) can exceed what a contiguous cache of
        the same bytes holds (benchmarks/sampler_paged.py).
      page_size: tokens per page (P >= 1), "paged" only.
      num_pages: pages in the pool of one sampler replica (split evenly over its decode
        lanes), "paged" only; at least one full-length sequence per lane,
        ceil((max_prefill_length + max_tokens) / page_size); 0 (default): num_slots times
        that (the contiguous cache's bytes). Multi-turn episodes are never preempted: a
        pool they exhaust stops the sampler with an error naming this field.
      paged_attention: decode attention over pages, "paged" only: "gather" (an XLA gather of
        each slot's pages, any backend), "kernel" (the Pallas TPU kernel
        ``jax.experimental.pallas.ops.tpu.paged_attention``, TPU only), "auto" (default:
        "kernel" on TPU, "gather" elsewhere).
      quantization: the engine's projection weights, "none" (default: the sampler dtype) or
        "int8": at every weight swap, once per version, each projection kernel (attention
        q/k/v/o, MLP gate/up/down, an untied LM head) is quantized with qwix to int8 with
        one symmetric absmax scale per output channel (per layer of a stacked kernel),
        stored int8 + scales in the sampler dtype; embeddings (a gather table, and with
        tied embeddings the LM head too), norms and biases stay in the sampler dtype, and
        so does the KV cache. Weight-only: activations stay in the sampler dtype. On TPU /
        GPU the engine holds int8 + scales and dequantizes each kernel in front of its dot
        inside the jitted call (qwix's own path for a float x int8 dot, which XLA fuses);
        XLA:CPU fuses no such dot (a 135M decode step ran 0.6x float32 that way,
        benchmarks/sampler_throughput.py), so on the CPU backend the engine dequantizes once
        per version and decodes the same values at float32's speed and memory. The
        behaviour logprobs are those of the
        quantized policy; the learner's ``learner.rollout_correction`` (on by default:
        token-level truncated IS) corrects for it, and an explicit setting there, "off"
        included, is honoured (:mod:`rlflow.sampler.quantization`).
      journal_every_steps: the journal of partial generations (issue 53): N > 0 keeps a
        replica's samples in flight (tokens so far, behaviour logprobs, per-token versions)
        in ``<run folder>/journal/<replica>.npz`` (atomically, :mod:`rlflow.run.journal`)
        never more than N decode calls (of decode_steps_per_call steps each) behind
        decoding (a snapshot every N // 2 calls written on a writer thread; N = 1: every
        call, written on the decode thread), and a restarted replica or a resumed run
        resumes a re-leased prompt's samples from there by re-prefill of prompt + tokens so
        far, instead of generating them again: a kill -9 loses at most N decode calls per
        slot. A partial generation older than
        runtime.max_staleness is dropped (counted, ``sampler/journal_dropped_stale``); a
        damaged entry is skipped (``sampler/journal_damaged``). 0 (default): off. Needs
        kv_cache="paged" (its preemption path resumes the samples). Multi-turn episodes
        are journaled too (their turns, the environment's tokens with version -1, and a
        finished episode's reward); a resumed episode's environment is rebuilt by replaying
        its recorded turns (:meth:`rlflow.sampler.episodes.EpisodeDriver.resume`: the
        environment must answer the same turns alike, as it must reset alike per record;
        one that does not restarts its episode, ``sampler/episodes_replay_mismatch``).
    """

    num_slots: int = 16
    max_prefill_length: int = 64
    prefill_buckets: Tuple[int, ...] = (16, 32, 64)
    max_tokens: int = 16
    group_size: int = 4
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    on_long_prompt: Literal["error", "truncate"] = "error"
    num_devices: int = 1
    mesh: MeshConfig = field(default_factory=MeshConfig)
    seed: int = 0
    decode_steps_per_call: int = 8
    decode_lanes: int = 0
    max_prefill_batch: int = 4
    num_replicas: int = 1
    dtype: Optional[Literal["float32", "bfloat16"]] = None
    kernel_layout: KernelLayout = "auto"
    kv_cache: Literal["contiguous", "paged"] = "contiguous"
    page_size: int = 16
    num_pages: int = 0
    paged_attention: Literal["auto", "gather", "kernel"] = "auto"
    quantization: Quantization = "none"
    journal_every_steps: int = 0

    @property
    def pages_per_slot(self) -> int:
        """Pages of one full-length sequence: ceil((max_prefill_length + max_tokens) /
        page_size)."""
        return -(-(self.max_prefill_length + self.max_tokens) // self.page_size)

    @property
    def pool_pages(self) -> int:
        """Pages in a paged pool: num_pages, or num_slots x pages_per_slot for 0."""
        return self.num_pages or self.num_slots * self.pages_per_slot

    def __post_init__(self):
        _finite_floats(self, "sampler")
        for name in ("num_slots", "max_prefill_length", "max_tokens", "group_size", "num_devices",
                     "decode_steps_per_call", "max_prefill_batch", "num_replicas"):
            _positive(getattr(self, name), f"sampler.{name}")
        _check(isinstance(self.decode_lanes, int) and self.decode_lanes >= 0,
               "sampler.decode_lanes",
               f"must be an integer >= 0 (0: chosen by the sampler), got {self.decode_lanes!r}")
        _check(self.decode_lanes == 0 or self.num_slots % self.decode_lanes == 0,
               "sampler.decode_lanes",
               f"must divide sampler.num_slots={self.num_slots} (each lane decodes "
               f"num_slots / decode_lanes slots), got {self.decode_lanes}")
        _check(len(self.prefill_buckets) > 0, "sampler.prefill_buckets", "must not be empty")
        _check(list(self.prefill_buckets) == sorted(self.prefill_buckets),
               "sampler.prefill_buckets", f"must be increasing, got {self.prefill_buckets}")
        _check(max(self.prefill_buckets) == self.max_prefill_length, "sampler.prefill_buckets",
               f"largest bucket must equal sampler.max_prefill_length={self.max_prefill_length}")
        _check(self.temperature >= 0, "sampler.temperature",
               f"must be >= 0, got {self.temperature}")
        _check(self.top_k >= 0, "sampler.top_k", f"must be >= 0, got {self.top_k}")
        _check(0 < self.top_p <= 1, "sampler.top_p", f"must be in (0, 1], got {self.top_p}")
        _one_of(self.on_long_prompt, ("error", "truncate"), "sampler.on_long_prompt")
        _one_of(self.kernel_layout, KERNEL_LAYOUTS, "sampler.kernel_layout")
        _one_of(self.kv_cache, ("contiguous", "paged"), "sampler.kv_cache")
        _one_of(self.paged_attention, ("auto", "gather", "kernel"), "sampler.paged_attention")
        _one_of(self.quantization, QUANTIZATIONS, "sampler.quantization")
        _positive(self.page_size, "sampler.page_size")
        _check(isinstance(self.journal_every_steps, int) and self.journal_every_steps >= 0,
               "sampler.journal_every_steps",
               f"must be an integer >= 0 (0: no journal), got {self.journal_every_steps!r}")
        _check(self.journal_every_steps == 0 or self.kv_cache == "paged",
               "sampler.journal_every_steps",
               f"needs sampler.kv_cache='paged' (a journaled sample resumes by the paged "
               f"pool's preemption path), got kv_cache={self.kv_cache!r}")
        _check(isinstance(self.num_pages, int) and (self.num_pages == 0 or
                                                    self.num_pages >= self.pages_per_slot),
               "sampler.num_pages",
               f"must be 0 (num_slots x pages per slot) or at least the "
               f"{self.pages_per_slot} pages of one full-length sequence (max_prefill_length "
               f"+ max_tokens = {self.max_prefill_length + self.max_tokens} tokens in pages of "
               f"{self.page_size}), got {self.num_pages!r}")
        _check(self.dtype is None or self.dtype in DTYPES, "sampler.dtype",
               f"must be None (the model's dtypes) or one of {list(DTYPES)}, got {self.dtype!r}")
        _check(self.mesh.sequence == 1, "sampler.mesh.sequence",
               f"must be 1: the sequence axis (context parallelism) is a learner layout; "
               f"give the sampler's devices to data / fsdp / tensor, got {self.mesh.sequence}")
        _check(self.mesh.num_devices == self.num_devices, "sampler.mesh",
               f"has {self.mesh.num_devices} devices but sampler.num_devices={self.num_devices}")
