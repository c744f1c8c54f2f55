"""Time the sampler's decode loop is blocked by scoring: blocking vs overlapped rewards.

GSM8K-like groups (G = 8 chat-model completions each, ``math_verify``) are scored two ways
by the real :class:`rlflow.data.rewarder.Rewarder`:

  * ``blocking``: ``score_group`` per finished group (the loop waits for the rewards);
  * ``overlapped``: ``submit_group`` per finished group (what the sampler program does; the
    workers score while decoding goes on), then ``collect`` until all are in.

Printed::

    RESULT reward_blocking_loop_ms_per_group <value> ms
    RESULT reward_overlapped_loop_ms_per_group <value> ms   (time inside submit + collect(0))
    RESULT reward_overlapped_drain_ms_per_group <value> ms  (wall time until every group is in)
    RESULT reward_loop_block_ratio <value> x                (blocking / overlapped loop time)
    RESULT reward_gil_bomb_return_s <value> s   (\\boxed{10^{10^{9}}} vs $x + 1$, timeout 2 s)

Usage: ``python benchmarks/reward_overlap.py [--groups 24] [--workers 2]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlflow.config import RewardConfig  # noqa: E402
from rlflow.data.rewarder import Rewarder  # noqa: E402


def completions(i: int) -> list:
    n = 10 + i
    return [f"Step 1: {n} apples.\nStep 2: she eats 3, so {n} - 3 = {n - 3}.\n#### {n - 3}",
            f"#### Step 1\nShe has {n}.\n#### Step 2\nThe answer is $\\boxed{{{n - 3}}}$.",
            f"So **{n - 2}** apples.", f"\\boxed{{\\frac{{{2 * (n - 3)}}}{{2}}}}",
            f"I think {n}.", "#### 3", f"The final answer is {n - 3}.", "no idea"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=24)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    cfg = RewardConfig(functions=("math_verify",), weights=(1.0,), timeout_s=2.0,
                       num_workers=args.workers)
    groups = [(i, completions(i), f"#### {10 + i - 3}") for i in range(args.groups)]
    with Rewarder(cfg) as r:
        r.score_group(0, ["#### 1"], "#### 1")             # workers up and warm
        t0 = time.perf_counter()
        blocking = [r.score_group(i, c, a) for i, c, a in groups]
        t_block = time.perf_counter() - t0

        loop = 0.0
        t0 = time.perf_counter()
        done = []
        for i, c, a in groups:
            t = time.perf_counter()
            r.submit_group(i, i, c, a)
            done += r.collect(0.0)
            loop += time.perf_counter() - t
        while len(done) < len(groups):
            t = time.perf_counter()
            done += r.collect(0.0)
            loop += time.perf_counter() - t
            time.sleep(0.005)                               # "one decode step"
        t_drain = time.perf_counter() - t0
        assert [k for k, _ in done] == [i for i, _, _ in groups]
        for (_, batch), want in zip(done, blocking):
            assert batch.total.tolist() == want.tolist()

        t0 = time.perf_counter()
        # an expression reference: against a number the power is no value and scores 0 at
        # once (answers are values); against x + 1 math-verify computes it (GIL held)
        r.score_group(0, ["\\boxed{10^{10^{9}}}"], "$x + 1$")
        t_bomb = time.perf_counter() - t0
    n = len(groups)
    print(f"RESULT reward_blocking_loop_ms_per_group {1e3 * t_block / n:.2f} ms")
    print(f"RESULT reward_overlapped_loop_ms_per_group {1e3 * loop / n:.2f} ms")
    print(f"RESULT reward_overlapped_drain_ms_per_group {1e3 * t_drain / n:.2f} ms")
    print(f"RESULT reward_loop_block_ratio {t_block / max(loop, 1e-9):.1f} x "
          f"blocking vs overlapped")
    print(f"RESULT reward_gil_bomb_return_s {t_bomb:.2f} s")


if __name__ == "__main__":
    main()
