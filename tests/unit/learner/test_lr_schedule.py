"""Issue 14 item 3: the learning-rate schedule is indexed by update (k = 1 is the first), so
no update of the run is wasted at rate 0: warmup starts at lr / W, cosine reaches its floor
after the last update, and a resumed optimiser continues the schedule."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlflow.config import LearnerConfig
from rlflow.learner.optimizer import lr_schedule, make_optimizer

F32_EPS = float(np.finfo(np.float32).eps)
# One schedule value: a handful of float32 ops (division, cos, products), each rounding by at
# most eps/2 relative: 8 eps relative covers them. Near the cosine's end 1 + cos(x) cancels
# (cos(x) ~ -1 carries an absolute error of ~eps), so the absolute error there is ~eps * lr / 2:
# atol = 4 eps * lr covers it (and the values that are exactly 0).
RTOL = 8 * F32_EPS


def atol(lr):
    return 4 * F32_EPS * lr


def oracle(k, *, lr, warmup, num_steps, schedule):
    """numpy rate of update k (1-based), written from the docstring's formulas."""
    if k <= warmup:
        return lr * k / warmup
    if schedule == "constant":
        return lr
    progress = min(k - warmup - 1, num_steps - warmup) / (num_steps - warmup)
    return lr * 0.5 * (1.0 + np.cos(np.pi * progress))


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 4])
def test_schedule_values_per_update(schedule, warmup):
    cfg = LearnerConfig(lr=2e-3, warmup_steps=warmup, num_steps=20, schedule=schedule)
    sched = lr_schedule(cfg)
    for k in range(1, 26):                       # optax passes count = k - 1
        want = oracle(k, lr=2e-3, warmup=warmup, num_steps=20, schedule=schedule)
        np.testing.assert_allclose(float(sched(k - 1)), want, rtol=RTOL, atol=atol(2e-3),
                                   err_msg=f"update {k}")


def test_first_update_end_of_warmup_and_last_update():
    cfg = LearnerConfig(lr=1e-3, warmup_steps=4, num_steps=10, schedule="cosine")
    sched = lr_schedule(cfg)
    np.testing.assert_allclose(float(sched(0)), 1e-3 / 4, rtol=RTOL)   # update 1: lr / W
    np.testing.assert_allclose(float(sched(3)), 1e-3, rtol=RTOL)       # update W: lr
    np.testing.assert_allclose(float(sched(4)), 1e-3, rtol=RTOL)       # first decay update
    # every update of the run has a positive rate; the floor comes after the last update
    assert all(float(sched(c)) > 0 for c in range(10))
    assert float(sched(10)) == 0.0 and float(sched(11)) == 0.0
    last = 1e-3 * 0.5 * (1 + np.cos(np.pi * 5 / 6))                    # update 10 of 10
    np.testing.assert_allclose(float(sched(9)), last, rtol=RTOL, atol=atol(1e-3))


def test_first_adamw_update_with_warmup_changes_the_params():
    """The issue's input: lr=1e-3, warmup 4. Adam's first update is lr_1 * g / (|g| + eps)
    (bias-corrected moments m = g, v = g^2), so with |g| = 1 >> eps = 1e-8 each parameter moves
    by lr / 4 against its gradient's sign."""
    tx, _ = make_optimizer(LearnerConfig(lr=1e-3, warmup_steps=4, max_grad_norm=0.0))
    params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
    grads = {"w": jnp.array([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]]), "b": -jnp.ones(3)}
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    # |delta| = lr/4 * 1/(1 + 1e-8): relative rounding of a few float32 ops
    np.testing.assert_allclose(np.asarray(new["w"]), -np.sign(grads["w"]) * 2.5e-4, rtol=RTOL)
    np.testing.assert_allclose(np.asarray(new["b"]), np.full(3, 2.5e-4), rtol=RTOL)


def test_resumed_optimizer_continues_the_schedule():
    """The count is optimiser state: an optimiser rebuilt from the config and handed the saved
    state takes update 4 at the rate of update 4 (not of update 1)."""
    cfg = LearnerConfig(lr=1e-2, warmup_steps=2, num_steps=6, schedule="cosine",
                        max_grad_norm=0.0)
    params = {"w": jnp.zeros(2)}
    grads = {"w": jnp.ones(2)}

    def updates(n, state):
        tx, _ = make_optimizer(cfg)
        out = []
        for _ in range(n):
            u, state = tx.update(grads, state, params)
            out.append(float(-u["w"][0]))
        return out, state

    tx, sched = make_optimizer(cfg)
    straight, _ = updates(6, tx.init(params))
    first, saved = updates(3, tx.init(params))
    rest, _ = updates(3, saved)                   # "resume" with the saved opt_state
    np.testing.assert_allclose(first + rest, straight, rtol=RTOL)
    # constant gradients: Adam's m / sqrt(v) is 1, so each update is the scheduled rate
    want = [oracle(k, lr=1e-2, warmup=2, num_steps=6, schedule="cosine") for k in range(1, 7)]
    # (Adam adds eps = 1e-8 to |g| = 1 and bias-corrects: a few more float32 roundings)
    np.testing.assert_allclose(straight, want, rtol=2 * RTOL, atol=atol(1e-2))
