"""Context parallelism (the learner's ``sequence`` mesh axis, issue 43 item 4): what XLA
compiles for the forward + gradient of the decoder's layers with the rows' positions split
over 1, 2 and 4 fake CPU devices, and what the ``shard_map`` attention saves over leaving
attention to XLA's auto-partitioner.

Compiles only (``lower().compile()``; nothing runs): ``grad(sum(hidden_states ** 2))`` of a
hidden-64 / 2-layer decoder (4 heads, 2 KV heads) on rows of ``T`` tokens with segment ids,
``remat="full"``, blockwise attention in blocks of 128 (the default 512 would make one
block's scores, not the activations, the largest temporary of this small model), sharded
``T`` over ``sequence``
(:meth:`rlflow.models.decoder.Decoder.hidden_states` with the mesh). Per device, from
``compiled.memory_analysis()`` / ``cost_analysis()`` and the optimised HLO text:

* ``cp_temp_mib_seq<s>``: temporaries per device at ``sequence = s`` (the activations kept
  for the backward shrink as ``T / s``; the gathered keys / values do not);
* ``cp_<scheme>_all_gathers`` / ``_all_to_alls`` / ``_reduce_scatters`` at ``sequence = 4``
  for ``shard_map`` (:mod:`rlflow.models.context_parallel`: one all-gather of K/V and of the
  key mask operands per layer, reduce-scatter of their cotangents) and ``auto`` (the same
  blockwise attention on the sequence-sharded activations, partitioned by XLA).

(XLA's ``cost_analysis`` counts a while loop's body once, whatever its trip count, so its
FLOPs of these scanned programs are not reported.)

Usage: ``.venv/bin/python benchmarks/context_parallel.py [--seq 1024]`` (a few minutes on 2
shared cores).
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
from flax import nnx  # noqa: E402

from rlflow.config import MeshConfig, ModelConfig  # noqa: E402
from rlflow.mesh import batch_sharding, make_mesh, param_shardings  # noqa: E402
from rlflow.models import attention as A  # noqa: E402
from rlflow.models import context_parallel  # noqa: E402
from rlflow.models.hf import build_model  # noqa: E402

MODEL = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16)


def compile_grad(sequence: int, rows: int, seq: int):
    """The compiled gradient program on a ``sequence``-device mesh."""
    model, _ = build_model(MODEL)
    graphdef, params = nnx.split(model, nnx.Param)
    mesh = make_mesh(MeshConfig(sequence=sequence), jax.devices()[:sequence])
    bs = batch_sharding(mesh)
    tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=bs)
    mask = jax.ShapeDtypeStruct((rows, seq), jnp.bool_, sharding=bs)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            params, param_shardings(params, mesh))

    def loss(p, t, m):
        h = nnx.merge(graphdef, p).hidden_states(
            t, jnp.cumsum(m, axis=1) - 1, m, segment_ids=t % 3, attention_impl="blockwise",
            remat="full", mesh=mesh).hidden
        return jnp.sum(h.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss)).lower(abstract, tokens, mask).compile()


def figures(compiled) -> dict:
    text = compiled.as_text()
    return {"temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2 ** 20,
            "all_gathers": len(re.findall(r"all-gather(?:-start)?\(", text)),
            "all_to_alls": len(re.findall(r"all-to-all\(", text)),
            "reduce_scatters": len(re.findall(r"reduce-scatter\(", text))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=1024, help="tokens per row")
    parser.add_argument("--rows", type=int, default=2)
    args = parser.parse_args()
    A.BLOCK = 128
    for s in (1, 2, 4):
        f = figures(compile_grad(s, args.rows, args.seq))
        print(f"RESULT cp_temp_mib_seq{s} {f['temp_mib']:.2f} MiB per device, T={args.seq}")
        if s == 4:
            for k in ("all_gathers", "all_to_alls", "reduce_scatters"):
                print(f"RESULT cp_shard_map_{k} {f[k]} ops in the HLO")
    def auto(q, k, v, *, mesh, **kw):         # the same attention, partitioned by XLA
        n = mesh.shape["sequence"]
        out = A.attention(*(context_parallel.unfold(x, n) for x in (q, k, v)), **kw)
        return context_parallel.fold(out, n)

    context_parallel.folded_attention = auto
    f = figures(compile_grad(4, args.rows, args.seq))
    print(f"RESULT cp_auto_temp_mib_seq4 {f['temp_mib']:.2f} MiB per device")
    for k in ("all_gathers", "all_to_alls", "reduce_scatters"):
        print(f"RESULT cp_auto_{k} {f[k]} ops in the HLO")
    return 0


if __name__ == "__main__":
    sys.exit(main())
