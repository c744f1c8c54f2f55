"""configs/dapo_qwen3_8b_16k.py: DAPO on Qwen3-8B with 1K + 15K-token rows, on the TPU slices
the memory model picks; its scripts/tpu dry run checks the memory against the slices."""

import os

import pytest

from dry_run_memory import check_memory_line, tpu_dry_run
from rlflow.console import fit
from rlflow.console.config_args import parse_train_args

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
CONFIG = os.path.join(REPO, "configs", "dapo_qwen3_8b_16k.py")


@pytest.fixture
def dapo(monkeypatch):
    """The config as the scripts load it where they run: no model folder (random init of
    Qwen3-8B's published architecture)."""
    monkeypatch.delenv("RLFLOW_MODEL_PATH", raising=False)
    return parse_train_args(["--config", CONFIG])


def test_the_config_is_dapo_on_qwen3_8b_with_16k_rows(dapo):
    lr, sp = dapo.learner, dapo.sampler
    assert fit.architecture(dapo).num_params() == 8_190_735_360     # Qwen3-8B's count
    assert dapo.model.model_type == "qwen3" and not dapo.model.path
    assert (sp.max_prefill_length, sp.max_tokens) == (1024, 15360)
    assert lr.clip_high > lr.clip_low and lr.dynamic_sampling and lr.kl_coef == 0
    assert lr.loss_agg == "token-mean" and 0 < lr.overlong_buffer < sp.max_tokens
    assert (lr.remat, lr.attention, lr.logprob_chunk) == ("full", "splash", 1024)


def test_it_fits_the_slice_the_memory_model_picks_and_not_a_smaller_one(dapo):
    arch = fit.architecture(dapo)
    picked = dict(fit.smallest_slice(dapo, arch, ("v5p", "v6e")))
    assert set(picked) == {"v5p-8", "v6e-16"}
    # the config is laid out for the v5p pick: its learner is fit_to_slice's
    assert fit.fit_to_slice(dapo, "v5p-8").learner == dapo.learner
    found = fit.check_memory(dapo, device_bytes=fit.device_memory("v5p-8"),
                             sampler_device_bytes=fit.device_memory("v5p-8"))
    assert found.learner_fits and found.sampler_fits
    # v6e-8: the same one row a chip, 8 chips of 32 GB: the parameters and AdamW state
    # leave too little room; the refusal says more chips
    small = fit.fit_to_slice(dapo, "v6e-8")
    with pytest.raises(fit.MemoryDoesNotFit, match=r"^learner.mesh: the learner needs "
                                                   r".* more than 90% of a v6e-8 chip"):
        fit.check_memory(small, device_bytes=fit.device_memory("v6e-8"),
                         where=fit.chip_name("v6e-8"))


def _start(*extra):
    return tpu_dry_run("dapo", "configs/dapo_qwen3_8b_16k.py", "/home/me/Qwen3-8B", "v5p-8", "v5p-8", 4, *extra)


def test_scripts_dry_run_prints_the_memory_and_refuses_rows_that_do_not_fit():
    proc = _start()
    assert proc.returncode == 0, proc.stderr
    # float32 params, the version published in the bfloat16 sampler's dtype
    check_memory_line(proc.stderr, "v5p-8", published_over_params=0.5)
    assert "tpu-vm ssh dapo-learner" in proc.stdout
    # 8 rows a chip per micro-batch: refused before any command, naming the setting
    proc = _start("--", "--learner.micro-batches", "16")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "error: learner.micro_batches: the learner needs " in proc.stderr
    assert "set --learner.micro-batches 32 " in proc.stderr
