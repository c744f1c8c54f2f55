"""A short synthetic run written through the public MetricsWriter API (for the metrics and
report tests). Values come from a seeded numpy generator, so tests can recompute them."""

from __future__ import annotations

import numpy as np

from rlflow.config import ExperimentConfig, LearnerConfig, MetricsConfig
from rlflow.run.metrics import REQUIRED_METRICS, STALENESS_HIST, MetricsWriter

NUM_STEPS = 6
SAMPLES_EVERY = 2
NUM_SAMPLES = 3
GROUP = 5  # samples offered per step (more than NUM_SAMPLES: the writer keeps the first 3)


def expected_metrics(step: int) -> dict[str, float]:
    """The metric values of ``step``: staleness fractions that sum to 1, the rest seeded."""
    rng = np.random.default_rng(step)
    values = {name: float(rng.uniform(0.1, 2.0)) for name in REQUIRED_METRICS
              if name not in STALENESS_HIST}
    fracs = rng.dirichlet(np.ones(len(STALENESS_HIST)))
    values.update({name: float(f) for name, f in zip(STALENESS_HIST, fracs)})
    return values


def sample(step: int, i: int) -> dict:
    return {"prompt": f"Q{step}.{i}: what is {step} + {i}? <b>|pipe|</b>",
            "completion": f"The answer is {step + i}.\nDone & dusted",
            "reward": float(i % 2), "version": step - 1, "truncated": bool(i == 0)}


def write_run(run_dir: str, name: str = "synthetic") -> ExperimentConfig:
    """Write NUM_STEPS steps (sampler and learner figures in separate ``log`` calls, as the
    two programs report them) and return the config written."""
    cfg = ExperimentConfig(
        name=name, run_dir=run_dir,
        learner=LearnerConfig(num_steps=NUM_STEPS, lr=3e-6),
        metrics=MetricsConfig(samples_every=SAMPLES_EVERY, num_samples=NUM_SAMPLES))
    with MetricsWriter.for_experiment(cfg) as writer:
        for step in range(1, NUM_STEPS + 1):
            values = expected_metrics(step)
            sampler = {k: np.float32(v) if k.startswith("sampler/") else v
                       for k, v in values.items() if k.startswith(("sampler/", "buffer/"))}
            writer.log(step, sampler)
            writer.log(step, {k: v for k, v in values.items() if k not in sampler})
            if writer.samples_due(step):
                writer.log_samples(step, [sample(step, i) for i in range(GROUP)])
    return cfg
