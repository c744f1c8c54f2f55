"""The TPU scripts' dry run (``scripts/tpu/start.sh --dry-run``) and its memory line, read back
and checked against the memory model's relations rather than against figures copied from a
run."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tpu_dry_run(name: str, config: str, model_dir: str, learner_type: str, sampler_type: str,
                sampler_slices: int, *extra: str) -> subprocess.CompletedProcess:
    """``scripts/tpu/start.sh --dry-run`` for ``config`` (a path from the repository root)
    with a fixed zone, project, learner IP and run folder, ``RLFLOW_BUFFER_TOKEN`` set and
    ``RLFLOW_MODEL_PATH`` unset; ``extra`` appended (e.g. ``"--", "--learner.x", "1"``)."""
    env = {k: v for k, v in os.environ.items() if k != "RLFLOW_MODEL_PATH"}
    env["RLFLOW_BUFFER_TOKEN"] = "t"
    return subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "tpu", "start.sh"), "--dry-run", "--zone",
         "us-east5-a", "--project", "p", "--name", name, "--learner-ip", "10.0.0.7",
         "--learner-type", learner_type, "--sampler-type", sampler_type,
         "--sampler-slices", str(sampler_slices), "--config", config, "--model-dir", model_dir,
         "--run-dir", "gs://b/runs", *extra],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


_LINE = re.compile(
    r"memory: learner per device: params ([\d.]+), optimizer ([\d.]+), grads ([\d.]+), "
    r"reference ([\d.]+), published ([\d.]+), activations ([\d.]+) = ([\d.]+) GiB of a "
    r"(\S+) chip \(([\d.]+) GiB\)")


def check_memory_line(stderr: str, learner_type: str, *, published_over_params: float) -> dict:
    """The learner terms of the dry run's memory line (GiB a chip), after checking: Adam's two
    moments and the gradients are 2x the float32 params, the published version is the params
    cast to the sampler's dtype (``published_over_params``), the terms add up to the total
    (each printed to 0.1 GiB) and the total fits 90% of the chip."""
    m = _LINE.search(stderr)
    assert m, stderr
    params, opt, grads, ref, published, act, total = map(float, m.groups()[:7])
    assert m.group(8) == learner_type
    chip = float(m.group(9))
    # each figure is printed to 0.1 GiB: |printed - exact| <= 0.05, so 2 x params may differ
    # from a printed 2 x term by 3 x 0.05
    assert opt == pytest.approx(2 * params, abs=0.151)
    assert grads == pytest.approx(2 * params, abs=0.151)
    assert ref == 0.0
    assert published == pytest.approx(published_over_params * params, abs=0.05 * (1 + published_over_params) + 1e-3)
    assert total == pytest.approx(params + opt + grads + ref + published + act, abs=0.35)
    assert total <= 0.9 * chip
    return dict(params=params, published=published, activations=act, total=total)
