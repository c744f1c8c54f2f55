"""The learner's optimiser: optax AdamW with global-norm clipping and a warmup/cosine schedule."""

from __future__ import annotations

import jax
import optax


def lr_schedule(cfg) -> optax.Schedule:
    """Learning rate as a function of optax's update count, from a
    :class:`rlflow.config.LearnerConfig`.

    optax calls the schedule with ``count`` = updates already applied, so the value at
    ``count`` is the rate of update ``k = count + 1`` (``k = 1`` is the first update). With
    ``W = warmup_steps``, ``N = num_steps`` and peak ``lr``:

    * warmup, ``k <= W``: ``lr * k / W`` (the first update uses ``lr / W``, never 0; update
      ``W`` uses ``lr``);
    * ``"constant"``: ``lr`` for ``k > W``;
    * ``"cosine"``, ``k > W``: ``lr * (1 + cos(pi * (k - W - 1) / (N - W))) / 2``: the first
      update after warmup uses ``lr``, the last one (``k = N``) a rate above 0, and the rate
      reaches its floor 0 at ``count = N`` (after the run's last update: no update of the run
      is taken with rate 0). Past ``N`` (more updates than configured) it stays 0.

    The count lives in the optimiser state, so a resumed run (checkpointed ``opt_state``)
    continues the schedule where it stopped. Skipped steps (no loss tokens) leave the count
    unchanged, so they do not advance the schedule either.
    """
    w, n, lr = cfg.warmup_steps, cfg.num_steps, cfg.lr
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, decay_steps=max(n - w, 1), alpha=0.0)
    else:
        after = optax.constant_schedule(lr)
    if w == 0:
        return after
    # count 0 .. W-1 -> lr/W .. lr (transition_steps = W - 1; W = 1 is the constant lr).
    warm = optax.linear_schedule(lr / w, lr, transition_steps=w - 1)
    return optax.join_schedules([warm, after], [w])


def decay_mask(params):
    """Weight decay on matrices only (ndim >= 2), not on norm scales or biases."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``clip_by_global_norm(max_grad_norm)`` (0: off) then ``adamw(schedule, b1, b2, wd)``.

    AdamW: Loshchilov & Hutter 2019, Algorithm 2; decay masked by :func:`decay_mask`;
    ``schedule`` is :func:`lr_schedule` (its value at the optimiser's count is the rate of
    the update being taken).

    Returns: ``(transformation, schedule)``.
    """
    schedule = lr_schedule(cfg)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    parts = ([optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm > 0 else []) + \
        [adamw]
    return optax.chain(*parts), schedule
