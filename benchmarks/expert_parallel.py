"""Expert parallelism (the ``expert`` mesh axis, issue 40 item 2): what XLA compiles for the
forward + gradient of one mixture-of-experts layer's experts split over 4 fake CPU devices,
with the ``shard_map`` dispatch of :mod:`rlflow.models.expert_parallel` (all-gather the
tokens over ``expert``, the local experts by ``jax.lax.ragged_dot``, reduce-scatter) against
the same dropless experts left to XLA's auto-partitioner (the expert weights sharded over
``expert`` as the mesh rules place them, tokens over ``data x fsdp x expert``).

Compiles only (``lower().compile()``; nothing runs): ``grad(sum(out * c))`` with respect to
the tokens and the three expert weights, ``N`` tokens of width ``E``, ``X`` experts of
width ``F``, top-``k``. Per device, from the optimised HLO text and
``compiled.memory_analysis()``:

* ``ep_<route>_<collective>_mib``: MiB of the results of every all-gather, reduce-scatter,
  all-reduce and all-to-all in the program (a collective's result size: what a device
  holds after it);
* ``ep_<route>_temp_mib``: temporaries per device;
* ``ep_<route>_expert_weight_gathers``: all-gathers whose result is a whole expert weight
  ``[X, E, F]`` / ``[X, F, E]`` (each device then holds every expert: what expert
  parallelism is meant to avoid).

Usage: ``.venv/bin/python benchmarks/expert_parallel.py [--tokens 2048]`` (about a minute
on 2 shared cores).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from rlflow.config import MeshConfig  # noqa: E402
from rlflow.mesh import BATCH_AXES, logical_sharding, make_mesh  # noqa: E402
from rlflow.models.expert_parallel import DOWN_AXES, GATE_UP_AXES, expert_ffn  # noqa: E402
from rlflow.models.moe import dispatch  # noqa: E402

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "f16": 2}


def _shape_bytes(dtype: str, dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n * _BYTES.get(dtype, 4)


def figures(compiled, x_shape, f_shape) -> dict:
    text = compiled.as_text()
    out = {}
    gathers_of_weights = 0
    for op in COLLECTIVES:
        total = 0
        for dtype, dims in re.findall(rf"= ([a-z0-9]+)\[([0-9,]*)\][^ ]* {op}(?:-start)?\(", text):
            total += _shape_bytes(dtype, dims)
            shape = tuple(int(d) for d in filter(None, dims.split(",")))
            if op == "all-gather" and shape in (x_shape, f_shape):
                gathers_of_weights += 1
        out[f"{op.replace('-', '_')}_mib"] = total / 2 ** 20
    out["expert_weight_gathers"] = gathers_of_weights
    out["temp_mib"] = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--expert-width", type=int, default=128)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    args = p.parse_args()
    n, e, f, x, k = args.tokens, args.hidden, args.expert_width, args.experts, args.top_k
    mesh = make_mesh(MeshConfig(expert=4), jax.devices()[:4])
    rng = np.random.default_rng(0)
    tok = NamedSharding(mesh, P(BATCH_AXES))
    xs = jax.device_put(jnp.asarray(rng.normal(size=(n, e)), jnp.float32), tok)
    ids = jax.device_put(jnp.asarray(np.argsort(-rng.random((n, x)), 1)[:, :k], jnp.int32), tok)
    gates = jax.device_put(jnp.full((n, k), 1.0 / k, jnp.float32), tok)
    put = lambda a, axes: jax.device_put(a, logical_sharding(mesh, axes, a.shape))  # noqa: E731
    wg = put(jnp.asarray(rng.normal(size=(x, e, f)), jnp.float32), GATE_UP_AXES)
    wu = put(jnp.asarray(rng.normal(size=(x, e, f)), jnp.float32), GATE_UP_AXES)
    wd = put(jnp.asarray(rng.normal(size=(x, f, e)), jnp.float32), DOWN_AXES)
    cot = jnp.cos(jnp.arange(n * e, dtype=jnp.float32)).reshape(n, e)
    routes = {"shard_map": lambda *a: expert_ffn(*a, mesh=mesh, experts_fn=dispatch),
              "auto": lambda *a: dispatch(*a)}
    print(f"# {n} tokens x {e}, {x} experts of {f}, top-{k}, expert=4 fake CPU devices")
    for name, fn in routes.items():
        grad = jax.jit(jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) * cot), argnums=(0, 3, 4, 5)))
        compiled = grad.lower(xs, ids, gates, wg, wu, wd).compile()
        for key, value in figures(compiled, (x, e, f), (x, f, e)).items():
            unit = "" if key.endswith("gathers") else " MiB per device"
            print(f"RESULT ep_{name}_{key} {value:.3f}{unit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
