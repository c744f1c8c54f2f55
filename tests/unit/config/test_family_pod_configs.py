"""Pod configs of the 2026 families (issue 51): configs/gsm8k_qwen3_5_35b_a3b.py
(Qwen3.5-35B-A3B: gated DeltaNet hybrid with experts) reads its sizes from its config.json
alone, fits the slice the memory model picks and not a smaller one, and the TPU scripts' dry
run prints its memory line."""

import dataclasses
import os
import re

import pytest

from dry_run_memory import check_memory_line, tpu_dry_run
from rlflow.config import MeshConfig
from rlflow.console import fit
from rlflow.console.config_args import parse_train_args
from rlflow.sampler.memory import gdn_state_bytes, kv_cache_bytes

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
CONFIG = os.path.join(REPO, "configs", "gsm8k_qwen3_5_35b_a3b.py")


@pytest.fixture
def qwen35(monkeypatch):
    monkeypatch.delenv("RLFLOW_MODEL_PATH", raising=False)
    return parse_train_args(["--config", CONFIG])


def test_the_config_is_qwen3_5_35b_a3b(qwen35):
    arch = fit.architecture(qwen35)
    assert arch.kinds.count("linear_attention") == 30 and arch.attention_layers == 10
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size,
            arch.shared_expert_intermediate_size) == (256, 8, 512, 512)
    assert round(arch.num_params() / 1e9, 2) == 34.66          # "35B" total
    assert qwen35.learner.mesh == MeshConfig(fsdp=2, expert=8)
    assert not qwen35.learner.shared_prefix
    # the sampler's state: 10 layers of keys and values, 30 DeltaNet states a slot
    sp = qwen35.sampler
    kv = sp.num_slots * (sp.max_prefill_length + sp.max_tokens) * 10 * 2 * 2 * 256 * 2
    assert kv_cache_bytes(qwen35, arch) == kv + sp.num_slots * 30 * gdn_state_bytes(arch, 2)


def test_it_fits_the_slice_the_memory_model_picks_and_not_a_smaller_one(qwen35):
    arch = fit.architecture(qwen35)
    picked = dict(fit.smallest_slice(qwen35, arch, ("v5p", "v6e")))
    assert set(picked) == {"v5p-32", "v6e-64"}
    assert fit.fit_to_slice(qwen35, "v5p-32").learner == dataclasses.replace(qwen35.learner,
                                                                            num_hosts=4)
    found = fit.check_memory(qwen35, device_bytes=fit.device_memory("v5p-32"),
                             sampler_device_bytes=fit.device_memory("v5p-8"))
    assert found.learner_fits and found.sampler_fits
    with pytest.raises(fit.MemoryDoesNotFit, match=r"^learner\.mesh: "):
        fit.check_memory(fit.fit_to_slice(qwen35, "v5p-16"),
                         device_bytes=fit.device_memory("v5p-16"), where=fit.chip_name("v5p-16"))


def test_scripts_dry_run_prints_the_memory_of_the_picked_slices():
    proc = tpu_dry_run("q35", "configs/gsm8k_qwen3_5_35b_a3b.py", "/home/me/Qwen3.5-35B-A3B",
                       "v5p-32", "v5p-8", 2)
    assert proc.returncode == 0, proc.stderr
    check_memory_line(proc.stderr, "v5p-32", published_over_params=0.5)
    assert re.search(r"sampler replica [\d.]+ GiB, [\d.]+ GiB a device of a v5p-8 chip",
                     proc.stderr)
