"""``learner.rollout_correction``: importance weights and rejection between the learner's
(old) policy and the sampler's behaviour policy (the math:
:mod:`rlflow.learner.rollout_correction`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from rlflow.config.validation import _check, _finite_floats, _one_of

CORRECTION_LEVELS = ("off", "token", "sequence", "geometric")
REJECT_UNITS = ("token", "sequence", "group")


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Rollout correction: importance weights of the learner's old policy ``pi_old`` against
    the sampler's behaviour policy ``mu`` (the sampler's logprobs), applied on top of the
    chosen loss (GRPO, DAPO, Dr. GRPO, PPO). With ``rho_t = pi_old(y_t) / mu(y_t)`` on the
    sampled tokens ``T`` of one sample (environment tokens of a multi-turn episode never
    count), a *level* gives each token a weight: "token" ``rho_t``; "sequence" the product
    ``prod_T rho_t = exp(sum_T log rho_t)``; "geometric" the geometric mean
    ``exp(mean_T log rho_t)`` (verl's rollout correction, ``docs/algo/rollout_corr_math.md``
    sec. 3.3). The same diagnostics are logged every step whatever is set here
    (``mismatch/*``, ``rollout_correction/*``: :func:`rlflow.learner.step.make_train_step`).

    Switching sequence-level truncation on from config code::

        dataclasses.replace(cfg.learner, rollout_correction=RolloutCorrectionConfig(
            weight="sequence", weight_cap=5.0))

    Attributes:
      weight: level of the truncated importance weight that multiplies each token's loss
        (detached): ``w = clip(rho_level, weight_floor, weight_cap)`` (truncated IS, Yao et
        al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
        IMPALA eq. 1 with an optional floor); "off": weight 1. With
        ``learner.off_policy="behaviour"`` the PPO ratio is already ``pi / mu`` and no weight
        is applied (the rejection below still is). Default "token" with cap 2: the
        decoupled PPO objective of AReaL (Fu et al. 2025).
      weight_cap: upper truncation C of the weight (> 0; sequence-level products need a
        larger one than token ratios, verl uses 2 to 10).
      weight_floor: lower clamp of the weight (0: none), at most ``weight_cap``.
      reject: level of the rejection test (the "mask" mode): a token, sequence or group
        whose weight at this level leaves ``[reject_low, reject_high]`` is rejected: loss 0
        and gradient 0 (it stays in the loss aggregation's denominator, which is fixed
        before the learner's logprobs are known). "off": no rejection.
      reject_low: lower end of the accepted band (0: no lower end), in [0, 1].
      reject_high: upper end of the accepted band (0: no upper end), 0 or >= 1. At least
        one end is needed when ``reject`` is on. Geometric means need a tight band (verl:
        1.0001 to 1.001 per token of deviation).
      reject_unit: what leaves the loss when the test fails: "token" (only with
        ``reject="token"``: that token), "sequence" (the whole sample; with
        ``reject="token"``: any one token out of band drops its sample, verl's veto), or
        "group" (every sample of the failing sample's prompt group; with
        ``learner.micro_batches > 1`` the step first runs a forward-only pass over the
        whole batch to find them). None: the level's own unit (token for "token", sequence
        for "sequence" and "geometric").
    """

    weight: Literal["off", "token", "sequence", "geometric"] = "token"
    weight_cap: float = 2.0
    weight_floor: float = 0.0
    reject: Literal["off", "token", "sequence", "geometric"] = "off"
    reject_low: float = 0.0
    reject_high: float = 0.0
    reject_unit: Optional[Literal["token", "sequence", "group"]] = None

    def __post_init__(self):
        where = "learner.rollout_correction"
        _finite_floats(self, where)
        _one_of(self.weight, CORRECTION_LEVELS, f"{where}.weight")
        _one_of(self.reject, CORRECTION_LEVELS, f"{where}.reject")
        _check(self.weight_cap > 0, f"{where}.weight_cap",
               f"must be > 0 (weight='off' turns the weight off), got {self.weight_cap}")
        _check(0 <= self.weight_floor <= self.weight_cap, f"{where}.weight_floor",
               f"must be in [0, weight_cap={self.weight_cap}], got {self.weight_floor}")
        _check(0 <= self.reject_low <= 1, f"{where}.reject_low",
               f"must be in [0, 1] (0: no lower end), got {self.reject_low}")
        _check(self.reject_high == 0 or self.reject_high >= 1, f"{where}.reject_high",
               f"must be 0 (no upper end) or >= 1, got {self.reject_high}")
        _check(self.reject == "off" or self.reject_low > 0 or self.reject_high > 0,
               f"{where}.reject", f"{self.reject!r} needs a band: set reject_low and/or "
               f"reject_high")
        if self.reject_unit is not None:
            _one_of(self.reject_unit, REJECT_UNITS, f"{where}.reject_unit")
            _check(self.reject_unit != "token" or self.reject in ("token", "off"),
                   f"{where}.reject_unit", f"'token' needs reject='token' (a {self.reject} "
                   f"weight belongs to the whole sample), got reject={self.reject!r}")

    @property
    def unit(self) -> str:
        """``reject_unit`` resolved: what a failed rejection test removes."""
        if self.reject_unit is not None:
            return self.reject_unit
        return "token" if self.reject == "token" else "sequence"

    @property
    def enabled(self) -> bool:
        """Whether the correction changes the loss (a weight or a rejection is on)."""
        return self.weight != "off" or self.reject != "off"
