"""On-policy distillation demo: a fresh student learns the digit task from a teacher alone.

Three steps, each what a user would run (``configs/distill_demo.py``):

1. the teacher: ``rlflow train`` on the built-in demo config (GRPO on the digit task,
   ``TEACHER_STEPS`` steps, default 300), skipped with ``--teacher PATH`` (an HF folder);
2. ``rlflow export --run <teacher run> --out <folder>``: the teacher as a Hugging Face folder;
3. the student: ``rlflow train --config configs/distill_demo.py --teacher.path <folder>``:
   the demo's initial random model, trained with ``teacher.mode="distill"`` (the per-token
   sampled reverse KL to the teacher as the advantage; the digit reward is scored for
   reporting only), ``DISTILL_STEPS`` steps (default: the config's 100).

Figures (``RESULT`` lines): the student's mean reward over the first and the last 10% of its
steps and the rise, the sampled reverse KL to the teacher (``distill/reverse_kl``, nats per
sampled token) over the same steps, the teacher forward's mean time per step
(``distill/teacher_time_s``), and the teacher's own last-10% reward. Runs go under a
temporary folder (``DISTILL_RUN_DIR`` to keep them). About 2-4 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runs import run_records  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEACHER_STEPS = int(os.environ.get("TEACHER_STEPS", "300"))
DISTILL_STEPS = int(os.environ.get("DISTILL_STEPS", "0"))      # 0: the config's


def load_config(name: str):
    spec = importlib.util.spec_from_file_location(f"rlflow_{name}_config",
                                                  os.path.join(REPO, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.config()


def run(cfg) -> dict:
    """``rlflow train`` of ``cfg`` (learner and sampler processes); its metrics by step."""
    from rlflow.run.folder import metrics_by_step

    return metrics_by_step(run_records(cfg))


def ends(by_step: dict, key: str) -> tuple[float, float]:
    """Mean of ``key`` over the first and the last 10% of the steps (at least one each)."""
    steps = sorted(s for s in by_step if key in by_step[s])
    k = max(1, len(steps) // 10)
    return (float(np.mean([by_step[s][key] for s in steps[:k]])),
            float(np.mean([by_step[s][key] for s in steps[-k:]])))


def main() -> int:
    from rlflow.config import MetricsConfig, replace
    from rlflow.export.hf_folder import ExportArgs, run_export

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", default="", help="teacher HF folder (skips steps 1-2)")
    args = parser.parse_args()
    root = os.environ.get("DISTILL_RUN_DIR") or tempfile.mkdtemp(prefix="rlflow-distill-")
    quiet = MetricsConfig(progress="plain", samples_every=0)
    teacher, teacher_last = args.teacher, float("nan")
    if not teacher:
        demo = load_config("demo")
        tcfg = replace(demo, name="distill-teacher", run_dir=root, metrics=quiet,
                       learner=replace(demo.learner, num_steps=TEACHER_STEPS))
        teacher_last = ends(run(tcfg), "reward/mean")[1]
        teacher = run_export(ExportArgs(out=os.path.join(root, "distill-teacher-export"),
                                        run=tcfg.run_path))
    base = load_config("distill_demo")
    scfg = replace(base, run_dir=root, metrics=quiet,
                   teacher=dataclasses.replace(base.teacher, path=teacher),
                   learner=replace(base.learner,
                                   num_steps=DISTILL_STEPS or base.learner.num_steps))
    by_step = run(scfg)
    r0, r1 = ends(by_step, "reward/mean")
    k0, k1 = ends(by_step, "distill/reverse_kl")
    t_teacher = float(np.mean([m["distill/teacher_time_s"] for m in by_step.values()
                               if "distill/teacher_time_s" in m][1:] or [float("nan")]))
    n = scfg.learner.num_steps
    note = f"student {n} steps, first/last 10% of steps, teacher {teacher}"
    print(f"RESULT distill_teacher_reward_last {teacher_last:.3f} reward of the RL-trained "
          f"teacher over its last 10% of {TEACHER_STEPS} steps (nan: --teacher given)")
    print(f"RESULT distill_reward_first {r0:.3f} mean reward (reporting only), {note}")
    print(f"RESULT distill_reward_last {r1:.3f} mean reward (reporting only), {note}")
    print(f"RESULT distill_reward_rise {r1 - r0:+.3f} reward, last 10% - first 10%")
    print(f"RESULT distill_reverse_kl_first {k0:.4f} nats/token sampled KL(student || teacher)")
    print(f"RESULT distill_reverse_kl_last {k1:.4f} nats/token sampled KL(student || teacher)")
    print(f"RESULT distill_teacher_forward_s {t_teacher:.4f} s per step (first step's compile "
          f"left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
