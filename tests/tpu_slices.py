"""Overrides that fit the scripts' default config (configs/gsm8k_qwen2_5_0_5b.py: learner 8
devices fsdp=8, sampler 8 devices data=4 x tensor=2) to other TPU slice types, for the
--dry-run tests of scripts/tpu and scripts/xpk (their slice check refuses a mismatch)."""

from __future__ import annotations

#: type -> (hosts, chips per host), as scripts/tpu/common.sh's slice_shape.
SHAPES = {"v5litepod-8": (1, 8), "v6e-8": (1, 8), "v5litepod-16": (4, 4), "v6e-16": (4, 4),
          "v5p-16": (2, 4), "v5p-32": (4, 4), "v6e-64": (16, 4), "v4-16": (2, 4)}


def fit(learner: str = "v5litepod-8", sampler: str = "v5litepod-8") -> list[str]:
    """``rlflow train`` overrides giving the learner every chip of ``learner`` (mesh fsdp;
    micro-batches so that the 512 samples of a step still divide) and each sampler replica
    the chips of one ``sampler`` host (mesh data x tensor=2)."""
    hosts, chips = SHAPES[learner]
    devices = hosts * chips
    out = []
    if devices != 8:
        out += ["--learner.num_devices", str(devices), "--learner.mesh.fsdp", str(devices),
                "--learner.micro_batches", str(max(1, 128 // devices))]
    per_host = SHAPES[sampler][1]
    if per_host != 8:
        out += ["--sampler.num_devices", str(per_host), "--sampler.mesh.data",
                str(per_host // 2)]
    return out
