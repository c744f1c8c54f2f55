"""The sampler's pause per weight version (rlflow.sampler.weight_pause): decode time lost to
the pull, the cast and the install of a version, against hand-computed figures."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from rlflow.sampler.weight_pause import SwapPauseMeter, Window, pause_parts


def _steps(durations, start=0.0):
    """Back-to-back steps of the given durations: ``[(t0, t1), ...]``."""
    t = start + np.concatenate([[0.0], np.cumsum(durations)])
    return list(zip(t[:-1].tolist(), t[1:].tolist()))


def test_parts_split_each_steps_excess_by_its_overlap():
    # baseline steps of 1 s; then 2 s, 2 s, 3 s steps; the install step 1.5 s
    steps = _steps([1, 1, 1, 2, 2, 3, 1.5])        # t: 0 1 2 3 5 7 10 11.5
    pull = Window(3.0, 6.0)          # all of step 3 (3-5) and half of step 4 (5-7)
    cast = Window(6.0, 10.5)         # the other half of step 4, step 5 (7-10), 0.5 of step 6
    got = pause_parts(steps, pull, cast, install_step=6)
    b = 1.0                          # median of the three steps overlapping nothing
    # step 3: excess 1 s, all in pull; step 4: excess 1 s, half pull half cast;
    # step 5: excess 2 s, all cast; step 6: excess 0.5 s over 1.5 s, 0.5 s of it in cast
    # (0.5 * 0.5 / 1.5), the rest (1 s of 1.5 s) install (0.5 * 1 / 1.5)
    assert got["baseline"] == pytest.approx(b)
    assert got["pull"] == pytest.approx(1.0 + 0.5)
    assert got["cast"] == pytest.approx(0.5 + 2.0 + 0.5 * 0.5 / 1.5)
    assert got["install"] == pytest.approx(0.5 * 1.0 / 1.5)
    assert got["pause"] == pytest.approx(got["pull"] + got["cast"] + got["install"])


def test_a_blocking_cast_counts_whole_and_faster_steps_lose_nothing():
    steps = _steps([2, 2, 2, 1, 2])      # a step faster than the baseline overlaps the pull
    pull = Window(6.0, 7.0)
    cast = Window(7.0, 7.0 + 0.25, blocking=True)      # on the decode thread, between steps
    got = pause_parts(steps, pull, cast, install_step=4)
    assert got["pull"] == 0.0 and got["install"] == 0.0
    assert got["cast"] == pytest.approx(0.25)
    assert got["pause"] == pytest.approx(0.25)


def test_no_windows_and_no_install_is_no_pause_and_bad_input_is_named():
    got = pause_parts(_steps([1, 2, 3]), None, None)
    assert got == {"pull": 0.0, "cast": 0.0, "install": 0.0, "pause": 0.0, "baseline": 2.0}
    with pytest.raises(ValueError, match="install_step 3"):
        pause_parts(_steps([1, 2, 3]), None, None, install_step=3)
    with pytest.raises(ValueError, match="end after it starts"):
        pause_parts([(1.0, 0.5)], None, None)
    with pytest.raises(ValueError, match="window"):
        Window(2.0, 1.0)


def test_meter_reports_the_swapped_version_with_consistent_parts():
    rng = np.random.default_rng(0)
    d = rng.uniform(0.9, 1.1, size=200)
    d[100:140] += rng.uniform(0.0, 0.5, size=40)      # slowed while the pull and cast ran
    steps = _steps(d)
    meter = SwapPauseMeter()
    assert meter.metrics() == {}
    pull = (steps[100][0], steps[129][1])
    cast = (steps[130][0], steps[139][1])
    # the puller thread notes its windows while the decode thread steps
    noter = threading.Thread(target=lambda: (meter.note(7, "pull", *pull),
                                             meter.note(6, "pull", 0.0, 1.0),
                                             meter.note(7, "cast", *cast)))
    noter.start()
    noter.join()
    for i, (t0, t1) in enumerate(steps):
        meter.step(t0, t1, swapped_to=7 if i == 140 else None)
    m = meter.metrics()
    oracle = pause_parts(steps[100 - 64:141], Window(*pull), Window(*cast), install_step=140 - 36)
    assert m["sampler/weight_pause_version"] == 7.0
    for p in ("pull", "cast", "install"):
        assert m[f"sampler/weight_pause_{p}_s"] == pytest.approx(oracle[p])
        assert m[f"sampler/weight_pause_{p}_s"] >= 0.0
    assert m["sampler/weight_pause_s"] == pytest.approx(sum(
        m[f"sampler/weight_pause_{p}_s"] for p in ("pull", "cast", "install")))
    # the slowdown was put in steps 100..139: the pause is near its sum
    assert m["sampler/weight_pause_s"] == pytest.approx((d[100:140] - 1.0).clip(0).sum(), rel=0.2)
    assert m["sampler/weight_transfer_s"] == pytest.approx(pull[1] - pull[0])
    assert m["sampler/weight_cast_s"] == pytest.approx(cast[1] - cast[0])
    assert meter._windows == {}          # version 6 (skipped) forgotten with 7's
    with pytest.raises(ValueError, match="part"):
        meter.note(8, "install", 0.0, 1.0)
