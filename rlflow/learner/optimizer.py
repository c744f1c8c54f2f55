"""The learner's optimiser: optax AdamW with global-norm clipping and a warmup/cosine schedule."""

from __future__ import annotations

import jax
import optax


def lr_schedule(cfg) -> optax.Schedule:
    """Learning rate per optimiser step from an :class:`rlflow.config.LearnerConfig`.

    Linear warmup from 0 over ``warmup_steps``, then ``"constant"`` at ``lr`` or ``"cosine"``
    decay to 0 at ``num_steps`` (``optax.warmup_cosine_decay_schedule``).
    """
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
            decay_steps=max(cfg.num_steps, cfg.warmup_steps + 1), end_value=0.0)
    if cfg.warmup_steps > 0:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), optax.constant_schedule(cfg.lr)],
            [cfg.warmup_steps])
    return optax.constant_schedule(cfg.lr)


def decay_mask(params):
    """Weight decay on matrices only (ndim >= 2), not on norm scales or biases."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``clip_by_global_norm(max_grad_norm)`` (0: off) then ``adamw(schedule, b1, b2, wd)``.

    AdamW: Loshchilov & Hutter 2019, Algorithm 2; decay masked by :func:`decay_mask`.

    Returns: ``(transformation, schedule)``.
    """
    schedule = lr_schedule(cfg)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    parts = ([optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm > 0 else []) + \
        [adamw]
    return optax.chain(*parts), schedule
