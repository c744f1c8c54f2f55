"""Pod configs of the 2026 families (issue 51): configs/gsm8k_qwen3_5_35b_a3b.py
(Qwen3.5-35B-A3B: gated DeltaNet hybrid with experts), configs/gsm8k_gpt_oss_20b.py and
configs/gsm8k_gemma3_27b.py (sliding-window layers) read their sizes from their config.json
alone (the published parameter counts), fit the slice the memory model picks and not a
smaller one, and the TPU scripts' dry run prints their memory line."""

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
    assert qwen35.learner.mesh == MeshConfig(fsdp=2, expert=8)
    assert not qwen35.learner.shared_prefix
    # the sampler's state: 10 layers of keys and values, 30 DeltaNet states a slot
    sp = qwen35.sampler
    kv = sp.num_slots * (sp.max_prefill_length + sp.max_tokens) * 10 * 2 * 2 * 256 * 2
    assert kv_cache_bytes(qwen35, arch) == kv + sp.num_slots * 30 * gdn_state_bytes(arch, 2)


#: (config, its learner slice and hosts, the v6e pick, a smaller v5p slice, billions of
#: parameters (the published counts), the families' layer kinds)
PODS = [("gsm8k_qwen3_5_35b_a3b", "v5p-32", 4, "v6e-64", "v5p-16", 34.66,
         {"linear_attention": 30, "full_attention": 10}),
        ("gsm8k_gpt_oss_20b", "v5p-32", 4, "v6e-32", "v5p-16", 20.91,
         {"sliding_attention": 12, "full_attention": 12}),
        ("gsm8k_gemma3_27b", "v5p-16", 2, "v6e-32", "v5p-8", 27.01,
         {"sliding_attention": 52, "full_attention": 10})]


def _load(name, monkeypatch):
    monkeypatch.delenv("RLFLOW_MODEL_PATH", raising=False)
    return parse_train_args(["--config", os.path.join(REPO, "configs", f"{name}.py")])


@pytest.mark.parametrize("name,v5p,hosts,v6e,smaller,billions,kinds", PODS,
                         ids=[p[0] for p in PODS])
def test_it_fits_the_slice_the_memory_model_picks_and_not_a_smaller_one(
        monkeypatch, name, v5p, hosts, v6e, smaller, billions, kinds):
    cfg = _load(name, monkeypatch)
    arch = fit.architecture(cfg)
    assert round(arch.num_params() / 1e9, 2) == billions
    assert {k: arch.kinds.count(k) for k in set(arch.kinds)} == kinds
    picked = dict(fit.smallest_slice(cfg, arch, ("v5p", "v6e")))
    assert set(picked) == {v5p, v6e}
    assert fit.fit_to_slice(cfg, v5p).learner == dataclasses.replace(cfg.learner,
                                                                      num_hosts=hosts)
    found = fit.check_memory(cfg, device_bytes=fit.device_memory(v5p),
                             sampler_device_bytes=fit.device_memory("v5p-8"))
    assert found.learner_fits and found.sampler_fits
    with pytest.raises(fit.MemoryDoesNotFit, match=r"^learner\.mesh: "):
        fit.check_memory(fit.fit_to_slice(cfg, smaller), device_bytes=fit.device_memory(smaller),
                         where=fit.chip_name(smaller))


@pytest.mark.parametrize("name,v5p,hosts", [p[:3] for p in PODS], ids=[p[0] for p in PODS])
def test_scripts_dry_run_prints_the_memory_of_the_picked_slices(name, v5p, hosts):
    proc = tpu_dry_run("fam", f"configs/{name}.py", "/home/me/model", v5p, "v5p-8", 2)
    assert proc.returncode == 0, proc.stderr
    check_memory_line(proc.stderr, v5p, published_over_params=0.5)
    assert re.search(r"sampler replica [\d.]+ GiB, [\d.]+ GiB a device of a v5p-8 chip",
                     proc.stderr)
    assert f"--learner.num_hosts {hosts}" in proc.stdout
