"""The tiny mixture-of-experts demo learns (issue 40 item 5): ``rlflow train`` on
``configs/moe_demo.py`` (the built-in digit task, a random Qwen3-MoE policy, rollout routing
replay on), then the mean reward over the first and the last 10% of its steps.

Figures (``RESULT`` lines): those two means and the rise (target >= 0.3), the router
agreement between the sampler's and the learner's expert choices and the behaviour-vs-learner
logprob gap (``moe/router_agreement``, ``moe/logprob_gap``) over the last 10%. The run goes
under a temporary folder (``MOE_DEMO_RUN_DIR`` to keep it); ``MOE_DEMO_STEPS`` shortens it
(default: the config's 300). A few minutes on 2 CPU cores.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runs import run_records  # noqa: E402
from distill_demo import ends, load_config  # noqa: E402

STEPS = int(os.environ.get("MOE_DEMO_STEPS", "0"))          # 0: the config's


def main() -> None:
    from rlflow.config import replace
    from rlflow.run.folder import metrics_by_step

    cfg = load_config("moe_demo")
    if STEPS:
        cfg = replace(cfg, learner=replace(cfg.learner, num_steps=STEPS))
    keep = os.environ.get("MOE_DEMO_RUN_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = replace(cfg, run_dir=keep or tmp)
        by_step = metrics_by_step(run_records(cfg))
    first, last = ends(by_step, "reward/mean")
    print(f"RESULT moe_demo_reward_first10 {first:.4f} reward mean over the first 10% of steps")
    print(f"RESULT moe_demo_reward_last10 {last:.4f} reward mean over the last 10% of steps")
    print(f"RESULT moe_demo_reward_rise {last - first:.4f} reward target>=0.3 "
          f"({len(by_step)} steps)")
    for key, name in (("moe/router_agreement", "moe_demo_router_agreement_last10"),
                      ("moe/logprob_gap", "moe_demo_logprob_gap_last10")):
        print(f"RESULT {name} {ends(by_step, key)[1]:.4f} "
              f"{'fraction' if 'agreement' in key else 'nats'} {key}, last 10% of steps")


if __name__ == "__main__":
    main()
