"""How often ``math_verify`` accepts an answer that is not a value, and what the rule costs.

Issue 44: GRPO on SmolLM2 learned to restate the question (``71 + 60, that's a easy one.``),
which math-verify scored 1 for the reference 131. With answers-are-values
(:mod:`rlflow.data.answer_values`) such completions score 0 while stated values and chains
``a + b = c`` keep scoring 1. Two-digit additions (seeded), each completion kind scored
against ``#### a+b``; then GSM8K's own worked solutions, without their ``#### N`` line
(math-verify's extraction of the last expression), against their references, to show no
correct solution is lost (when ``../shared/data/gsm8k/train.jsonl`` exists).

Printed (fractions scored 1)::

    RESULT answer_values_<kind>_accepted <fraction>   restate, boxed_expr, marked_expr: 0
    RESULT answer_values_gsm8k_solutions_accepted <fraction>
    RESULT answer_values_ms_per_call <ms>

Usage: ``python benchmarks/answer_values.py`` (``ANSWER_VALUES_N``: additions, default 200).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rlflow.data.rewards import math_verify_reward  # noqa: E402

KINDS = {"restate": "{a} + {b}, that's a easy one.", "boxed_expr": "\\boxed{{{a}+{b}}}",
         "marked_expr": "#### {a} + {b}", "chain": "{a} + {b} = {c}",
         "stated": "The answer is {c}.", "wrong_chain": "{a} + {b} = {w}"}


def main() -> None:
    n = int(os.environ.get("ANSWER_VALUES_N", "200"))
    pairs = np.random.default_rng(0).integers(10, 100, size=(n, 2))
    calls, t0 = 0, time.perf_counter()
    for kind, text in KINDS.items():
        score = sum(math_verify_reward(text.format(a=a, b=b, c=a + b, w=a + b + 1),
                                       f"#### {a + b}") for a, b in pairs)
        calls += n
        print(f"RESULT answer_values_{kind}_accepted {score / n:.3f}")
    per_call = (time.perf_counter() - t0) / calls
    path = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "train.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            recs = [json.loads(line) for _, line in zip(range(1000), f)]
        ok = sum(math_verify_reward(r["answer"].rsplit("####", 1)[0], r["answer"]) for r in recs)
        print(f"RESULT answer_values_gsm8k_solutions_accepted {ok / len(recs):.3f}")
    print(f"RESULT answer_values_ms_per_call {1e3 * per_call:.2f} ms")


if __name__ == "__main__":
    main()
