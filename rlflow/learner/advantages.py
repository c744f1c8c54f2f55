"""Rewards -> advantages: group baselines (GRPO, Dr. GRPO, RLOO), GAE, DAPO reward shaping.

Pure ``jax.numpy`` functions (they accept numpy arrays too). Shapes: ``N`` groups, ``G``
samples per group, ``B`` samples, ``T`` response tokens.

Host path: the reward-level functions (:func:`group_advantages`, :func:`zero_truncated_rewards`,
:func:`overlong_penalty`, :func:`groups_with_signal`) take ``xp=numpy`` to run the same code on
numpy arrays (returning numpy): the batch builder uses it, since a handful of eager ``jnp``
dispatches on ``[N, G]`` arrays costs milliseconds of learner host time per step. The
``jnp`` path (the default) is the tested reference; the numpy path is tested equal to it.

Numerics: group statistics are computed on rewards shifted by the group's first reward
(``r - r[:, :1]``). The shift changes no advantage mathematically, but a group whose rewards
are all equal then has deviations that are exactly 0 in float32, so it gets advantage 0,
never NaN and never ``residue / (residue_std + floor)`` (seven copies of 0.35 in float32 have
a mean that is not exactly 0.35; the unshifted z-score gives ~0.03 instead of 0).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Estimator = Literal["grpo", "drgrpo", "rloo"]


def group_advantages(rewards, *, estimator: Estimator = "grpo", scale_by_std: bool | None = None,
                     std_floor: float = 1e-6, xp=jnp, valid=None) -> jax.Array:
    """Per-sample advantages from the rewards of each group (one prompt's G completions).

    With deviations ``d_i = r_i - mean(r)`` and the unbiased group std
    ``s = sqrt(sum_i d_i^2 / (G - 1))`` (as ``torch.std`` in TRL/verl):

    - ``"grpo"``   (Shao et al. 2024, DeepSeekMath sec. 4.1.2): ``A_i = d_i / (s + floor)``.
    - ``"drgrpo"`` (Liu et al. 2025, "Understanding R1-Zero-Like Training", Dr. GRPO objective): ``A_i = d_i``.
    - ``"rloo"``   (leave-one-out baseline: Kool et al. 2019; Ahmadian et al. 2024, RLOO): ``A_i = r_i - mean_{j != i} r_j = G/(G-1) d_i``.

    ``scale_by_std`` overrides the std scaling (None: only GRPO scales); RLOO with std scaling
    is ``G/(G-1) d_i / (s + floor)``, bounded by ``sqrt(G)`` in magnitude (eight rewards
    seven x 0.35 and one 0.0: the lone 0.0 gets -0.35 unscaled, about -2.83 scaled).

    Args:
      rewards: ``[N, G]`` float rewards (computed in float32).
      estimator: "grpo", "drgrpo" or "rloo".
      scale_by_std: divide by ``s + std_floor`` (None: estimator's default).
      std_floor: added to the std before dividing (> 0 keeps zero-variance groups finite).
      xp: array namespace, ``jax.numpy`` (default) or ``numpy`` (host path, numpy result).
      valid: ``[N, G]`` bool, or None (all valid): the samples that form their group's
        baseline. The others (failed samples, ``learner.on_failed_sample="mask"``) get
        advantage 0 and no weight: every formula above runs over the ``G_n`` valid samples
        of group ``n`` alone (``G_n`` in place of ``G``); a group with fewer than 2 valid
        samples gets 0 wherever a formula needs 2 (RLOO, std scaling).

    Returns:
      ``[N, G]`` float32 advantages; exactly 0 for a group whose (valid) rewards are all
      equal, and where ``valid`` is False.

    Raises:
      ValueError: rewards not 2-D, unknown estimator, G < 2 where the estimator needs it,
        Dr. GRPO with std scaling, or a non-finite reward (naming group and sample).
    """
    r = xp.asarray(rewards, xp.float32)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {r.shape}")
    if estimator not in ("grpo", "drgrpo", "rloo"):
        raise ValueError(f"estimator must be 'grpo', 'drgrpo' or 'rloo', got {estimator!r}")
    if scale_by_std is None:
        scale_by_std = estimator == "grpo"
    if estimator == "drgrpo" and scale_by_std:
        raise ValueError("drgrpo means no std scaling (Liu et al. 2025); use estimator='grpo'")
    g = r.shape[1]
    if (estimator == "rloo" or scale_by_std) and g < 2:
        raise ValueError(f"estimator {estimator!r} (std scaling={scale_by_std}) needs group_size "
                         f">= 2, got {g}")
    _check_finite(r, xp)
    if valid is not None:
        return _valid_group_advantages(r, xp.asarray(valid, bool), estimator, scale_by_std,
                                       std_floor, xp)
    shifted = r - r[:, :1]
    dev = shifted - xp.mean(shifted, axis=1, keepdims=True)
    adv = dev * xp.float32(g / (g - 1)) if estimator == "rloo" else dev
    if scale_by_std:
        std = xp.sqrt(xp.sum(dev * dev, axis=1, keepdims=True) / xp.float32(g - 1))
        adv = adv / (std + xp.float32(std_floor))
    return adv


def _valid_group_advantages(r, valid, estimator, scale_by_std, std_floor, xp):
    """:func:`group_advantages` over the valid samples of each group (``valid [N, G]``)."""
    if valid.shape != r.shape:
        raise ValueError(f"valid {valid.shape} and rewards {r.shape} differ in shape")
    k = xp.sum(valid, axis=1, keepdims=True).astype(xp.float32)          # G_n
    first = xp.take_along_axis(r, xp.argmax(valid, axis=1)[:, None], axis=1)
    shifted = xp.where(valid, r - first, xp.float32(0.0))  # by a valid reward: exact zeros
    mean = xp.sum(shifted, axis=1, keepdims=True) / xp.maximum(k, xp.float32(1.0))
    dev = xp.where(valid, shifted - mean, xp.float32(0.0))
    two = k >= 2
    km1 = xp.maximum(k - 1, xp.float32(1.0))
    adv = xp.where(two, dev * (k / km1), xp.float32(0.0)) if estimator == "rloo" else dev
    if scale_by_std:
        std = xp.sqrt(xp.sum(dev * dev, axis=1, keepdims=True) / km1)
        adv = xp.where(two, adv / (std + xp.float32(std_floor)), xp.float32(0.0))
    return xp.where(valid, adv, xp.float32(0.0))


def flat_group_advantages(rewards, group_size: int, **kwargs) -> jax.Array:
    """:func:`group_advantages` on a flat ``[B]`` reward vector of consecutive groups.

    Raises:
      ValueError: ``group_size`` does not divide ``B`` (names both), or as group_advantages.
    """
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 1:
        raise ValueError(f"rewards must be [batch], got shape {r.shape}")
    if group_size <= 0 or r.shape[0] % group_size:
        raise ValueError(f"group_size {group_size} does not divide the batch of {r.shape[0]} "
                         f"rewards")
    return group_advantages(r.reshape(-1, group_size), **kwargs).reshape(-1)


def _check_finite(r, xp=jnp) -> None:
    try:
        bad = ~xp.isfinite(r)
        if bool(xp.any(bad)):
            n, i = (int(x) for x in xp.argwhere(bad)[0])
            raise ValueError(f"non-finite reward {float(r[n, i])} at group {n}, sample {i}")
    except jax.errors.ConcretizationTypeError:
        pass  # traced inside jit: the host-side batch builder checks rewards before this


def zero_truncated_rewards(rewards, truncated, *, xp=jnp) -> jax.Array:
    """Rewards with those of truncated completions (cut by ``max_tokens``) set to 0.

    Args:
      rewards: ``[...]`` float rewards.
      truncated: ``[...]`` bool, same shape.
      xp: ``jax.numpy`` (default) or ``numpy`` (host path).

    Returns: float32, same shape ([1,0,1,1] with [F,F,T,F] -> [1,0,0,1]).
    """
    rewards = xp.asarray(rewards, xp.float32)
    truncated = xp.asarray(truncated, bool)
    if rewards.shape != truncated.shape:
        raise ValueError(f"rewards {rewards.shape} and truncated {truncated.shape} differ in shape")
    return xp.where(truncated, xp.float32(0.0), rewards)


def overlong_penalty(lengths, *, max_tokens: int, buffer: int, factor: float = 1.0,
                     xp=jnp) -> jax.Array:
    """DAPO soft overlong punishment (Yu et al. 2025, "DAPO", sec. 3.4), times ``factor``.

    ``R(y) = 0`` if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` if
    ``L_max - L_cache < |y| <= L_max``; ``-1`` if ``|y| > L_max``; added to the task reward.

    Args:
      lengths: ``[...]`` int completion lengths in tokens (EOS included).
      max_tokens: ``L_max``.
      buffer: ``L_cache`` (> 0, <= max_tokens).
      factor: scale of the penalty.
      xp: ``jax.numpy`` (default) or ``numpy`` (host path).

    Returns: float32 ``[...]`` penalties in [-factor, 0].
    """
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"overlong buffer must be in (0, max_tokens={max_tokens}], got {buffer}")
    n = xp.asarray(lengths, xp.float32)
    start = xp.float32(max_tokens - buffer)
    pen = xp.clip((start - n) / xp.float32(buffer), xp.float32(-1.0), xp.float32(0.0))
    return xp.float32(factor) * pen


def groups_with_signal(rewards, *, xp=jnp, valid=None) -> jax.Array:
    """DAPO dynamic sampling filter (Yu et al. 2025, sec. 3.2): keep groups whose rewards differ.

    Args:
      rewards: ``[N, G]`` rewards.
      xp: ``jax.numpy`` (default) or ``numpy`` (host path).
      valid: ``[N, G]`` bool or None (all): only these rewards are compared (failed samples
        left out of the baseline, :func:`group_advantages`).

    Returns:
      ``[N]`` bool, False for groups with zero reward variance (exact comparison: all equal)
      among their valid samples.
    """
    r = xp.asarray(rewards, xp.float32)
    if valid is None:
        return xp.max(r, axis=1) > xp.min(r, axis=1)
    valid = xp.asarray(valid, bool)
    return xp.max(xp.where(valid, r, -xp.inf), axis=1) > xp.min(xp.where(valid, r, xp.inf),
                                                                axis=1)


def gae(rewards, values, mask, *, gamma: float = 1.0, lam: float = 0.95):
    """Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous
    Control Using Generalized Advantage Estimation", eq. 16) over the *sampled* tokens.

    The recursion runs over each row's valid tokens (``mask`` 1) in order, as if the masked
    tokens were not there: with ``n(t)`` the next valid position after ``t``,
    ``delta_t = r_t + gamma * V_{n(t)} - V_t`` and ``A_t = delta_t + gamma * lam * A_{n(t)}``
    (eq. 16's sum ``A_t = sum_l (gamma lam)^l delta_{t+l}`` over the compressed sequence);
    after the last valid token the value and advantage are 0 (the episode ends). In
    multi-turn episodes the environment's tokens between two turns (tool results, user turns:
    loss mask 0) are not actions of the policy, so the value and the advantage are carried
    across them rather than the episode ending there (the fix verl and miles made). On a
    contiguous mask this is the textbook recursion. Example (issue 44): mask
    ``1 1 1 0 0 0 1 1``, reward 1 on the last token, values ``.3 -.2 .5 . . . .1 .4``,
    ``gamma = 1``, ``lam = 0.95``: advantages ``[0.550, 1.105, 0.427]`` on the first turn
    and ``[0.87, 0.6]`` on the second. ``returns = A + V`` are the value-function targets.

    Args:
      rewards: ``[B, T]`` float per-token rewards (the sequence reward on its last token,
        see :func:`terminal_rewards`); ignored where ``mask`` is 0.
      values: ``[B, T]`` float value estimates V(s_t) of the policy's state before token t;
        ignored where ``mask`` is 0.
      mask: ``[B, T]`` bool/0-1 mask of the sampled tokens (gaps allowed).
      gamma, lam: discount and GAE lambda in [0, 1].

    Returns:
      ``(advantages, returns)``, both ``[B, T]`` float32, 0 where ``mask`` is 0. Jittable
      (one ``lax.scan`` over ``T``).

    Raises:
      ValueError: the three arrays are not equal ``[B, T]`` shapes.
    """
    m = jnp.asarray(mask, jnp.float32)
    r = jnp.where(m > 0, jnp.asarray(rewards, jnp.float32), 0.0)
    v = jnp.where(m > 0, jnp.asarray(values, jnp.float32), 0.0)
    if not (r.shape == v.shape == m.shape and r.ndim == 2):
        raise ValueError(f"rewards {r.shape}, values {v.shape}, mask {m.shape} must be equal [B, T]")

    def back(carry, xs):
        v_next, a_next = carry             # of the next valid token (0 after the last one)
        r_t, v_t, m_t = xs
        a = r_t + gamma * v_next - v_t + gamma * lam * a_next
        valid = m_t > 0
        a = jnp.where(valid, a, 0.0)
        return (jnp.where(valid, v_t, v_next), jnp.where(valid, a, a_next)), a

    zeros = jnp.zeros(r.shape[0], jnp.float32)
    _, adv = jax.lax.scan(back, (zeros, zeros), (r.T, v.T, m.T), reverse=True)
    adv = adv.T
    return adv, (adv + v) * m


def terminal_rewards(rewards, mask) -> jax.Array:
    """Place each sequence reward ``[B]`` on the last valid token of ``mask [B, T]``.

    Returns: ``[B, T]`` float32, zero elsewhere (rows without valid tokens are all zero).
    """
    m = jnp.asarray(mask, bool)
    n = jnp.sum(m, axis=1)
    last = jnp.max(jnp.where(m, jnp.arange(m.shape[1])[None, :], -1), axis=1)
    onehot = (jnp.arange(m.shape[1])[None, :] == last[:, None]) & (n[:, None] > 0)
    return jnp.where(onehot, jnp.asarray(rewards, jnp.float32)[:, None], 0.0)


def masked_whiten(x, mask, eps: float = 1e-8) -> jax.Array:
    """Advantage whitening over the valid entries: ``(x - mu) / sqrt(var + eps)``.

    ``mu`` and the population variance ``var`` are taken over entries where ``mask`` is set
    (e.g. all response tokens of a batch; as TRL's ``masked_whiten``, without Bessel's
    correction). Any shape (``[B, T]``, or ``[k, B/k, T]`` micro-batches: the statistics are
    over every valid entry). Returns float32, 0 where ``mask`` is 0; all-zero mask -> zeros.
    """
    m = jnp.asarray(mask, jnp.float32)
    v = jnp.where(m > 0, jnp.asarray(x, jnp.float32), 0.0)
    n = jnp.maximum(jnp.sum(m), 1.0)
    mu = jnp.sum(v) / n
    var = jnp.sum(m * (v - mu) ** 2) / n
    return m * (v - mu) * jax.lax.rsqrt(var + eps)


def ppo_targets(token_rewards, old_values, mask, *, gamma: float, lam: float,
                old_logprobs=None, ref_logprobs=None, kl_coef: float = 0.0):
    """GAE advantages and value targets of PPO for one batch of response tokens.

    Token rewards (Ouyang et al. 2022, InstructGPT eq. 2, per token as in Stiennon et al.
    2020): ``r_t = R 1[t = last] - kl_coef (log pi_old - log pi_ref)_t`` (the KL term only
    when ``ref_logprobs`` is given), then :func:`gae` with the *old* values (detached,
    Schulman et al. 2017 eq. 11-12): ``returns = A + V_old``.

    Args:
      token_rewards: ``[B, T]`` float32, the sequence reward on its last response token.
      old_values: ``[B, T]`` float32 ``V_old(s_t)`` at the step start (treated as constants).
      mask: ``[B, T]`` mask of the sampled response tokens (multi-turn episodes: gaps on
        the environment's tokens, which :func:`gae` skips).
      gamma, lam: GAE discount and lambda.
      old_logprobs, ref_logprobs: ``[B, T]`` logprobs of the targets under the old and the
        reference policy (KL-in-reward; both or neither).
      kl_coef: KL-in-reward coefficient.

    Returns: ``(advantages, returns)``, float32 ``[B, T]``, 0 where ``mask`` is 0, no gradient.
    """
    m = jnp.asarray(mask, bool)
    r = jnp.where(m, jnp.asarray(token_rewards, jnp.float32), 0.0)
    if ref_logprobs is not None:
        if old_logprobs is None:
            raise ValueError("KL-in-reward needs old_logprobs with ref_logprobs")
        d = jnp.where(m, jnp.asarray(old_logprobs, jnp.float32)
                      - jnp.asarray(ref_logprobs, jnp.float32), 0.0)
        r = r - kl_coef * d
    adv, ret = gae(r, old_values, m, gamma=gamma, lam=lam)
    return jax.lax.stop_gradient(adv), jax.lax.stop_gradient(ret)
