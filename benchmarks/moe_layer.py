"""The Qwen3-MoE layer's dropless dispatch (:func:`rlflow.models.moe.dispatch`: pairs sorted
by expert, ``jax.lax.ragged_dot`` over the experts' row groups) against the baseline that runs
every expert on every token and masks by the gates (the ``[n, N, F]`` einsum a dense
implementation computes), forward + backward, jitted, on the default device.

Figures (``RESULT`` lines, benchmarks/README.md):

* ``moe_dropless_ms`` / ``moe_all_experts_ms``: best-of wall time of one forward + backward
  of the expert computation (router excluded) for ``N`` tokens;
* ``moe_dropless_speedup``: all-experts time over dropless time (the all-experts baseline
  does ``n / k`` times the FLOPs; ~``n / k`` is the bound).

Sizes from the environment: ``MOE_TOKENS`` (2048), ``MOE_HIDDEN`` (256), ``MOE_WIDTH``
(128), ``MOE_EXPERTS`` (16), ``MOE_TOP_K`` (2), ``MOE_REPEATS`` (5). Both sides compute the
same values (checked).

On the CPU backend the speedup is below 1: jax 0.10's ``ragged_dot`` has native lowerings
for TPU and GPU only; elsewhere it runs ``_ragged_dot_general_impl``, which expands the
``N k`` sorted rows to a masked ``[n, N k, E]`` operand and multiplies it densely by every
expert: ``k`` times the all-experts baseline's FLOPs. Measured on 2 shared CPU cores (load
~9): 0.67x at the defaults (1244 vs 832 ms), 0.41x at N=512 E=64 F=32 n=8 k=2 (4.2 vs
1.7 ms), 0.29x at N=4096 E=256 F=64 n=64 k=4 (18.7 vs 5.5 s).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _timing import best_of  # noqa: E402  (the script's folder)
from rlflow.models.moe import dispatch, route  # noqa: E402


def all_experts(x, ids, gates, wg, wu, wd):
    """Every expert on every token, combined with the gates scattered to ``[N, n]``."""
    n = wg.shape[0]
    h = jax.nn.silu(jnp.einsum("te,nef->ntf", x, wg)) * jnp.einsum("te,nef->ntf", x, wu)
    out = jnp.einsum("ntf,nfe->nte", h, wd)                            # [n, N, E]
    dense_gates = jnp.sum(jax.nn.one_hot(ids, n, dtype=x.dtype) * gates[..., None], axis=1)
    return jnp.einsum("tn,nte->te", dense_gates, out)


def main() -> None:
    tokens = int(os.environ.get("MOE_TOKENS", 2048))
    e = int(os.environ.get("MOE_HIDDEN", 256))
    f = int(os.environ.get("MOE_WIDTH", 128))
    n = int(os.environ.get("MOE_EXPERTS", 16))
    k = int(os.environ.get("MOE_TOP_K", 2))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(tokens, e)), jnp.float32)
    wg, wu = (jnp.asarray(rng.normal(size=(n, e, f)) * e ** -0.5, jnp.float32) for _ in "gu")
    wd = jnp.asarray(rng.normal(size=(n, f, e)) * f ** -0.5, jnp.float32)
    routing = route(jnp.asarray(rng.normal(size=(tokens, n)), jnp.float32), k, True)
    ids, gates = routing.expert_ids, routing.gates

    def step(fn):
        def loss(x, wg, wu, wd):
            return jnp.sum(fn(x, ids, gates, wg, wu, wd) ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

    ours, base = step(dispatch), step(all_experts)
    a, b = ours(x, wg, wu, wd), base(x, wg, wu, wd)
    np.testing.assert_allclose(float(a[0]), float(b[0]), rtol=1e-4)
    repeats = int(os.environ.get("MOE_REPEATS", 5))
    t_ours = best_of(lambda: jax.block_until_ready(ours(x, wg, wu, wd)), repeats)
    t_base = best_of(lambda: jax.block_until_ready(base(x, wg, wu, wd)), repeats)
    cfg = f"N={tokens} E={e} F={f} n={n} k={k} {jax.default_backend()}"
    print(f"RESULT moe_dropless_ms {t_ours * 1e3:.2f} ms {cfg}")
    print(f"RESULT moe_all_experts_ms {t_base * 1e3:.2f} ms {cfg}")
    print(f"RESULT moe_dropless_speedup {t_base / t_ours:.2f} x bound~{n / k:.0f} {cfg}")


if __name__ == "__main__":
    main()
