"""Hugging Face tensor names of a Qwen3-MoE layer's MLP (:class:`rlflow.models.moe.MoE`).

On disk (``Qwen3MoeForCausalLM.save_pretrained``, transformers 4.x and 5.x alike; 5.x fuses
the experts in memory only, through its ``conversion_mapping``), layer ``i`` holds

* ``model.layers.{i}.mlp.gate.weight`` ``[n, E]``: the router, rlflow ``router [E, n]``;
* ``model.layers.{i}.mlp.experts.{j}.{gate,up}_proj.weight`` ``[F, E]`` and
  ``...experts.{j}.down_proj.weight`` ``[E, F]`` for each expert ``j``: slice ``j`` of
  rlflow's ``gate_kernel`` / ``up_kernel`` ``[n, E, F]`` and ``down_kernel`` ``[n, F, E]``,
  transposed.

Expert entries have the kind :data:`EXPERT_LINEAR`, and their rlflow path ends with the
expert index ``j`` (an index into the parameter's leading ``expert`` axis), which
:mod:`rlflow.models.hf` reads and writes slice by slice.
"""

from __future__ import annotations

EXPERT_LINEAR = "expert_linear"   # HF [out, in] -> slice j of an rlflow [n, in, out] kernel


def moe_weight_map(num_experts: int, layer: int) -> list[tuple[str, tuple, str]]:
    """``(hf_name, rlflow path, kind)`` of layer ``layer``'s MoE MLP (module doc)."""
    hf, ours = f"model.layers.{layer}.mlp.", ("layers", layer, "mlp")
    m = [(hf + "gate.weight", ours + ("router",), "linear")]
    for p in ("gate", "up", "down"):
        m += [(hf + f"experts.{j}.{p}_proj.weight", ours + (f"{p}_kernel", j), EXPERT_LINEAR)
              for j in range(num_experts)]
    return m


def is_expert_slice(kind: str) -> bool:
    """Whether an entry of kind ``kind`` is one expert's slice of a stacked kernel (its path's
    last element is the expert index)."""
    return kind == EXPERT_LINEAR
