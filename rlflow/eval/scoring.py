"""One evaluation, the parts shared by ``rlflow eval`` and the evaluation during training:
the held-out prompts, a finished group scored into a small per-prompt record, and the
records aggregated into metrics (:mod:`rlflow.eval.metrics`). Their sampling requests are the
sampler's (:func:`rlflow.sampler.eval_runner.eval_requests`).

A *prompt record* (plain JSON types: it travels from a sampler replica to the learner in
a status request, :mod:`rlflow.control.run_control`)::

    {"prompt_id": int,             # record index in the eval file
     "rewards": [k floats],        # total reward of each sample (eval reward functions)
     "correct": [k bools],         # reward >= the accuracy threshold
     "lengths": [k ints],          # completion tokens (stop id included)
     "truncated": [k bools],       # finish_reason "length" (hit max_tokens)
     "answers": [k strings],       # final answers (rlflow.data.rewards.completion_answer_text)
     "versions": [min, max],       # policy versions of the group's tokens
     "components": {fn: [k floats]},  # each reward function's unweighted rewards (optional)
     "prompt": str, "completion": str, "answer": str}   # the first sample, for the log
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Mapping, Sequence

import numpy as np

from rlflow.eval.metrics import eval_metrics

EVAL_SAMPLES_FILE = "eval_samples.jsonl"


def load_eval_prompts(cfg, tokenizer) -> list[dict]:
    """The held-out prompts of ``cfg.eval``: the first ``eval.num_prompts`` kept records in
    file order (all with 0), each ``{"prompt_id", "prompt_tokens" int32 [P], "prompt_text",
    "answer"}`` (the prompt pipeline's element format, :mod:`rlflow.data.pipeline`).

    Raises:
      rlflow.config.ConfigError: ``eval.path`` missing for a file source.
      FileNotFoundError / rlflow.data.sources.DataError: as the prompt pipeline (names the
        file, line and field).
    """
    from rlflow.config.eval import eval_data_config
    from rlflow.data.pipeline import make_formatter, scan

    data = eval_data_config(cfg)
    formatter, origin = make_formatter(data, tokenizer, seed=cfg.seed)
    kept, _ = scan(formatter, data, f"eval: {origin}")
    n = cfg.eval.num_prompts or len(kept)
    return [formatter(int(i)) for i in kept[:n]]


def zero_unclosed(rewards, unclosed: np.ndarray) -> np.ndarray:
    """``rewards`` float ``[k]`` with 0 where the reasoning never closed (``unclosed``, from
    :func:`rlflow.sampler.delivery.graded_texts`), as in training."""
    return np.where(unclosed, 0.0, np.asarray(rewards, np.float64))


def graded_rewards(batch, unclosed: np.ndarray) -> tuple[np.ndarray, dict]:
    """The total and per-function rewards of a scored group
    (:class:`rlflow.data.rewarder.RewardBatch`, ``[k]`` each) as the evaluation counts them:
    float64, 0 where the reasoning never closed (:func:`zero_unclosed`) and where a value is
    not finite (NaN/inf: scored 0, as a failed call, so the metrics stay finite).

    Returns:
      ``(rewards [k], {function name: [k]})``.
    """
    def graded(values):
        values = zero_unclosed(values, unclosed)
        return np.where(np.isfinite(values), values, 0.0)
    return graded(batch.total), {name: graded(v) for name, v in batch.components.items()}


def prompt_record(group, texts: Sequence[str], rewards, threshold: float, *,
                  prompt_text: str = "", answer: str = "",
                  components: Mapping[str, Sequence[float]] | None = None) -> dict:
    """A finished group of a held-out prompt as a prompt record (module docstring).

    Args:
      group: :class:`rlflow.sampler.requests.CompletedGroup` (k completions).
      texts: the k decoded completions.
      rewards: float ``[k]`` total rewards.
      threshold: reward at or above which a sample is correct.
      components: each reward function's unweighted rewards, float ``[k]`` (the record's
        ``"components"``; :func:`aggregate` reports their means); None: not recorded.
    """
    from rlflow.data.rewards import completion_answer_text

    rewards = np.asarray(rewards, np.float64).reshape(-1)
    versions = np.concatenate([c.versions for c in group.completions if len(c.versions)]
                              or [np.zeros(0, np.int32)])
    record = {"prompt_id": int(group.prompt_id),
              "rewards": [float(r) for r in rewards],
              "correct": [bool(r >= threshold) for r in rewards],
              "lengths": [int(len(c.tokens)) for c in group.completions],
              "truncated": [bool(c.truncated) for c in group.completions],
              "answers": [completion_answer_text(t).strip() for t in texts],
              "versions": [int(versions.min()), int(versions.max())] if versions.size else [],
              "prompt": prompt_text, "completion": texts[0] if texts else "", "answer": answer}
    if components is not None:
        record["components"] = {name: [float(v) for v in np.asarray(values).reshape(-1)]
                                for name, values in components.items()}
    return record


def aggregate(records: Sequence[Mapping]) -> dict[str, float]:
    """Metrics of one evaluation from its prompt records (:func:`eval_metrics`; records in
    any order; every record must have the same number of samples k). The reward functions
    that every record has ``components`` of get their mean, ``eval/reward/<name>``.

    Raises:
      ValueError: no records, or records with different k.
    """
    if not records:
        raise ValueError("aggregate: no prompt records")
    ks = {len(r["rewards"]) for r in records}
    if len(ks) != 1:
        raise ValueError(f"aggregate: prompt records have different sample counts {sorted(ks)}")
    names = set.intersection(*(set(r.get("components") or ()) for r in records))
    return eval_metrics([r["rewards"] for r in records], [r["correct"] for r in records],
                        [r["lengths"] for r in records], [r["truncated"] for r in records],
                        [r["answers"] for r in records],
                        components={n: [r["components"][n] for r in records]
                                    for n in sorted(names)})


def write_eval_samples(run_dir: str, version: int, records: Iterable[Mapping],
                       limit: int, *, name: str = EVAL_SAMPLES_FILE) -> list[dict]:
    """Append the first sample of up to ``limit`` prompt records (lowest prompt ids first)
    to ``<run_dir>/<name>`` (default ``eval_samples.jsonl``): ``{"step", "version",
    "prompt_id", "prompt", "completion", "answer", "reward", "correct", "truncated"}``
    per line (``step`` = ``version``, the policy version that generated it, as in
    ``samples.jsonl``; readable with :func:`rlflow.run.folder.read_jsonl`). Returns the
    rows written, as dicts (for :meth:`rlflow.run.metrics.MetricsWriter.log_eval_samples`)."""
    rows = [{"step": int(version), "version": int(version), "prompt_id": r["prompt_id"],
             "prompt": r.get("prompt", ""), "completion": r.get("completion", ""),
             "answer": r.get("answer", ""), "reward": r["rewards"][0],
             "correct": r["correct"][0], "truncated": r["truncated"][0]}
            for r in sorted(records, key=lambda r: r["prompt_id"])[:limit]]
    if rows:
        with open(os.path.join(run_dir, name), "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
    return rows
