"""Library kernels behind the backend seam: tokamax's grouped matmul (ragged dot) for the
mixture-of-experts layers and its memory-efficient linear + softmax cross-entropy for the
learner's logprobs. Each has a jnp path, the CPU reference and the parity oracle of the tests;
the accelerator path is chosen per backend (``resolve_*``, like
:func:`rlflow.models.attention.resolve`).

Ragged dot (``ragged_dot``): ``out[r] = lhs[r] @ rhs[g(r)]`` where row ``r`` lies in group
``g(r)`` of the contiguous groups of sizes ``group_sizes``; the rows past
``sum(group_sizes)`` are not computed (the callers mask them). ``"jnp"``:
``jax.lax.ragged_dot``; ``"tokamax"``: ``tokamax.ragged_dot`` with its default choice (the
Pallas Mosaic kernel on TPU, Triton / Mosaic GPU on NVIDIA GPUs, its XLA implementation
elsewhere, which the CPU tests run through this same seam). Default: ``"tokamax"`` on TPU and
GPU, ``"jnp"`` on CPU.

Linear + softmax logprobs (``linear_logprobs``): ``log softmax((h / T) @ W)[token]`` for
hidden states ``h [N, E]`` and the LM head ``W [E, V]`` without the ``[N, V]`` logits in
memory (Wijmans et al. 2025, "Cut Your Losses in Large-Vocabulary Language Models": the loss
as ``lse(h W) - (h W)[y]``, blocked over the vocabulary, recomputing blocks in the backward).
``"jnp"``: :func:`rlflow.models.logprobs.chunked_logprobs` (the caller's path, chunked over
the positions); ``"mosaic_tpu"`` (TPU default): tokamax's Pallas Mosaic TPU kernel;
``"xla"``: tokamax's reference implementation (materialises the logits; the CPU tests' way
through the seam). tokamax 0.0.17's ``"chunked_xla"`` is not offered: its losses are wrong
when the vocabulary is not a multiple of its 2048-wide vocabulary block (off by 0.16-0.43 nats
at V = 1000, 1024, 1500 against 1e-6 at 2048; tests/unit/models/test_kernels.py), so GPUs keep
the jnp chunked path. tokamax is imported only when a tokamax path runs (its import costs
seconds that a CPU process need not pay).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

RAGGED_DOT_IMPLEMENTATIONS = ("auto", "jnp", "tokamax")
LOGPROB_IMPLEMENTATIONS = ("auto", "jnp", "mosaic_tpu", "xla")


def resolve_ragged_dot(impl: str = "auto", backend: str | None = None) -> str:
    """The ragged-dot implementation ``impl`` names: ``"auto"`` -> ``"tokamax"`` on TPU and
    GPU, ``"jnp"`` elsewhere.

    Raises: ValueError naming the choices when ``impl`` is not one of
    :data:`RAGGED_DOT_IMPLEMENTATIONS`.
    """
    if impl not in RAGGED_DOT_IMPLEMENTATIONS:
        raise ValueError(f"ragged dot implementation: expected one of "
                         f"{RAGGED_DOT_IMPLEMENTATIONS}, got {impl!r}")
    if impl == "auto":
        return "tokamax" if (backend or jax.default_backend()) in ("tpu", "gpu") else "jnp"
    return impl


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
               impl: str = "auto") -> jax.Array:
    """Grouped matmul ``[M, K] x [G, K, N] -> [M, N]`` (module doc), ``jax.lax.ragged_dot``'s
    contract.

    Args:
      lhs: ``[M, K]`` rows sorted by group.
      rhs: ``[G, K, N]`` one matrix per group (``lhs.dtype``).
      group_sizes: ``[G]`` int32 rows per group, ``sum <= M``.
      impl: one of :data:`RAGGED_DOT_IMPLEMENTATIONS` (:func:`resolve_ragged_dot`).

    Returns: ``[M, N]`` in ``lhs.dtype``; rows past ``sum(group_sizes)`` are 0 on every
    path (a kernel leaves them unwritten, so the tokamax path zeroes them, and zeroes those
    rows of ``lhs`` so that no unwritten value reaches a gradient).
    """
    if resolve_ragged_dot(impl) == "jnp":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    import tokamax
    inside = (jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes))[:, None]
    out = tokamax.ragged_dot(jnp.where(inside, lhs, 0), rhs, group_sizes)
    return jnp.where(inside, out, 0).astype(lhs.dtype)


def resolve_logprobs(impl: str = "auto", backend: str | None = None) -> str:
    """The logprob implementation ``impl`` names: ``"auto"`` -> ``"mosaic_tpu"`` on TPU,
    ``"jnp"`` elsewhere (module doc: why not GPU).

    Raises: ValueError naming the choices when ``impl`` is not one of
    :data:`LOGPROB_IMPLEMENTATIONS`.
    """
    if impl not in LOGPROB_IMPLEMENTATIONS:
        raise ValueError(f"logprob implementation: expected one of "
                         f"{LOGPROB_IMPLEMENTATIONS}, got {impl!r}")
    if impl == "auto":
        return "mosaic_tpu" if (backend or jax.default_backend()) == "tpu" else "jnp"
    return impl


def linear_logprobs(hidden: jax.Array, weight: jax.Array, tokens: jax.Array,
                    temperature: float | jax.Array = 1.0, *, impl: str) -> jax.Array:
    """Tempered ``log softmax(hidden @ weight / T)[tokens]`` by a tokamax kernel (module doc),
    differentiable in ``hidden`` and ``weight``.

    Args:
      hidden: ``[N, E]`` final-normed hidden states (compute dtype).
      weight: ``[E, V]`` LM head (``hidden.dtype``).
      tokens: ``[N]`` int ids in ``[0, V)``.
      temperature: > 0 scalar; applied as ``hidden / T`` (``(h / T) W = (h W) / T``).
      impl: a tokamax implementation, ``"mosaic_tpu"`` or ``"xla"`` (not ``"jnp"``: that
        path is the caller's, :func:`rlflow.models.logprobs.chunked_logprobs`).

    Returns: ``[N]`` float32 logprobs.

    Raises: ValueError for ``"jnp"``/``"auto"`` or an unknown ``impl``, or mismatched shapes.
    """
    if impl not in LOGPROB_IMPLEMENTATIONS[2:]:
        raise ValueError(f"linear_logprobs: expected a tokamax implementation "
                         f"{LOGPROB_IMPLEMENTATIONS[2:]}, got {impl!r}")
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[0] \
            or tokens.shape != hidden.shape[:1]:
        raise ValueError(f"linear_logprobs: hidden {hidden.shape}, weight {weight.shape}, "
                         f"tokens {tokens.shape}: expected [N, E], [E, V] and [N]")
    import tokamax
    x = hidden / jnp.asarray(temperature, hidden.dtype)
    loss = tokamax.linear_softmax_cross_entropy_loss(
        x, tokens.astype(jnp.int32), weight.astype(x.dtype), reduction="none",
        implementation=impl)
    return -loss.astype(jnp.float32)
