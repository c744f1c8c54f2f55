"""Pure next-token sampling: greedy, temperature, top-k, top-p, one setting per row.

Every function here is a pure ``jax.numpy`` function, jit-able with per-row settings as
arrays, so one compiled decode step serves all slots whatever their settings.

The order of the logits processors is that of Hugging Face ``generate``
(``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper``), and top-p
is nucleus sampling (Holtzman et al. 2020, "The Curious Case of Neural Text
Degeneration", Sec. 3.1: the smallest set of most likely tokens whose mass >= p).

The draw is inverse-transform sampling (one uniform per row, found in the cumulative
distribution of the kept tokens: the method of ``torch.multinomial``), not Gumbel-max over
the vocabulary: it needs one random number per row instead of ``V``, which on CPU is most
of a decode step's sampling cost. Tokens with zero kept mass are never drawn; the uniform's
float32 resolution (2**-24) bounds the error on any token's probability.

Reported logprob. The sampler reports ``log softmax(logits / T)[token]``
(:func:`rlflow.models.logprobs.token_logprobs`, the one definition the learner also uses),
so behaviour and recomputed logprobs agree. At T = 0 (greedy) it is the T = 1 logprob.
With top-k / top-p the draw comes from the truncated, renormalised distribution, but the
reported logprob stays the untruncated tempered one (what a learner can recompute); the
two differ by the log of the kept mass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from rlflow.models.logprobs import token_logprobs


class SamplingError(ValueError):
    """A sampling setting or request is invalid; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    """Settings of one request (all its G samples).

    Attributes:
      temperature: >= 0; 0 is greedy (argmax).
      top_k: keep the k most likely tokens (0: off).
      top_p: nucleus mass in (0, 1] (1: off).
      max_tokens: most new tokens per completion, > 0.
      seed: per-request PRNG seed; sample ``i`` of the request draws token ``t`` with
        the uniform ``request_uniforms(seed, i, n)[t]`` (``n`` = the engine's
        ``sampler.max_tokens``), so results do not depend on slot, batch or k.
      stop_token_ids: token ids that end a completion (kept in it). ``None``: the model's
        EOS ids (every id of ``generation_config.eos_token_id``).

    Raises:
      SamplingError: a value outside its range (the message names the field).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int = 0
    stop_token_ids: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        def check(ok, name, msg):
            if not ok:
                raise SamplingError(f"sampling.{name}: {msg}")

        check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        check(int(self.top_k) == self.top_k and self.top_k >= 0, "top_k",
              f"must be an integer >= 0 (0: off), got {self.top_k}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(int(self.max_tokens) == self.max_tokens and self.max_tokens > 0, "max_tokens",
              f"must be an integer > 0, got {self.max_tokens}")
        check(0 <= int(self.seed) < 2**32, "seed", f"must be in [0, 2**32), got {self.seed}")
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            check(all(int(i) == i and i >= 0 for i in ids), "stop_token_ids",
                  f"must be non-negative token ids, got {ids}")
            object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))

    @classmethod
    def from_config(cls, sampler_cfg, **overrides) -> "SamplingParams":
        """Settings from a :class:`rlflow.config.SamplerConfig`, with ``overrides``."""
        base = dict(temperature=sampler_cfg.temperature, top_k=sampler_cfg.top_k,
                    top_p=sampler_cfg.top_p, max_tokens=sampler_cfg.max_tokens,
                    seed=sampler_cfg.seed)
        base.update(overrides)
        return cls(**base)

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array) -> jax.Array:
    """Tempered logits with tokens outside top-k / top-p set to -inf.

    Args:
      logits: float ``[B, V]``.
      temperature: float32 ``[B]``, > 0 (greedy rows are handled by the caller).
      top_k: int32 ``[B]``, 0 = off; ties with the k-th value are kept.
      top_p: float32 ``[B]`` in (0, 1]; 1 = off. The most likely token is always kept.

    Returns:
      float32 ``[B, V]``: ``logits / T`` where kept, ``-inf`` elsewhere.
    """
    x = logits.astype(jnp.float32) / temperature[:, None]
    vocab = x.shape[-1]

    def truncate(x):
        desc = -jnp.sort(-x, axis=-1)                                   # [B, V]
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)      # [B, 1]
        desc = jnp.where(desc >= kth, desc, -jnp.inf)
        p = jax.nn.softmax(desc, axis=-1)
        mass_before = jnp.cumsum(p, axis=-1) - p
        keep_sorted = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        n_keep = jnp.maximum(jnp.sum(keep_sorted & (desc > -jnp.inf), axis=-1), 1)
        threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
        return jnp.where(x >= jnp.maximum(threshold, kth), x, -jnp.inf)

    # The sort is skipped when no row truncates (the common RL setting).
    needed = jnp.any(top_k > 0) | jnp.any(top_p < 1.0)
    return jax.lax.cond(needed, truncate, lambda x: x, x)


def sample_tokens(logits: jax.Array, uniforms: jax.Array, temperature: jax.Array,
                  top_k: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row and return it with the logprob it was sampled with.

    Args:
      logits: float ``[B, V]`` next-token logits.
      uniforms: float32 ``[B]`` in ``[0, 1)``, one per row, specific to this token (see
        :func:`request_uniforms`).
      temperature: float32 ``[B]``, >= 0; 0 = greedy (argmax, ties to the lowest id).
      top_k: int32 ``[B]`` (0 = off); top_p: float32 ``[B]`` (1 = off).

    Returns:
      ``(tokens, logprobs)``: int32 ``[B]`` and float32 ``[B]``, the logprob
      ``log softmax(logits / T)[token]`` (T = 1 for greedy rows), see the module notes.
    """
    temperature = temperature.astype(jnp.float32)
    greedy = temperature <= 0.0
    t_eff = jnp.where(greedy, 1.0, temperature)
    masked = filter_logits(logits, t_eff, top_k.astype(jnp.int32), top_p.astype(jnp.float32))
    drawn = inverse_cdf_draw(uniforms, masked)
    # The argmax is skipped when no row is greedy (XLA CPU's arg-reduce is slow).
    argmax = jax.lax.cond(jnp.any(greedy), lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32),
                          lambda x: jnp.zeros(x.shape[:1], jnp.int32), logits)
    tokens = jnp.where(greedy, argmax, drawn).astype(jnp.int32)
    return tokens, token_logprobs(logits, tokens, t_eff)


def inverse_cdf_draw(uniforms: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw per row from ``softmax(logits)`` by inverse-transform sampling.

    Args:
      uniforms: float32 ``[B]`` in ``[0, 1)``; logits: float32 ``[B, V]`` (``-inf`` =
        excluded).

    Returns:
      int32 ``[B]``: the first token whose cumulative probability exceeds ``u * total``
      (``total`` = the cdf's last entry, so float32 rounding of the sum never selects
      past the last kept token).
    """
    u = uniforms.astype(jnp.float32)
    cdf = jnp.cumsum(jax.nn.softmax(logits, axis=-1), axis=-1)                 # [B, V]
    x = u * cdf[:, -1]
    idx = jnp.sum(cdf <= x[:, None], axis=-1)
    return jnp.minimum(idx, logits.shape[-1] - 1).astype(jnp.int32)


def request_uniforms(seed: jax.Array | int, sample_index: jax.Array | int,
                     num_tokens: int) -> jax.Array:
    """The uniforms of one sample's tokens: float32 ``[num_tokens]`` in ``[0, 1)``,
    ``uniform(request_key(seed, sample_index))``; token ``t`` is drawn with entry ``t``.

    Drawn once when a sample enters a slot, so a decode step only reads its entry
    (threefry on CPU runs as a rolled loop: two per step were a fifth of a small model's
    decode step).
    """
    return jax.random.uniform(request_key(seed, sample_index), (num_tokens,), jnp.float32)


def request_key(seed: jax.Array | int, sample_index: jax.Array | int) -> jax.Array:
    """Key of sample ``sample_index`` of a request seeded ``seed``: fold_in(key(seed), i)."""
    return jax.random.fold_in(jax.random.key(seed), sample_index)
