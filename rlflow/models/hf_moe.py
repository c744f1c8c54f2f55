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

Checkpoints that store the experts fused, as transformers 5.x holds them in memory
(``mlp.experts.gate_up_proj`` ``[n, 2F, E]``, gate rows first, and ``mlp.experts.down_proj``
``[n, E, F]``), are read too (:func:`stored_layout`); rlflow writes the per-expert layout.
"""

from __future__ import annotations

import numpy as np

EXPERT_LINEAR = "expert_linear"   # HF [out, in] -> slice j of an rlflow [n, in, out] kernel
# fused HF tensors -> a whole rlflow kernel
FUSED_GATE, FUSED_UP, FUSED_DOWN = "fused_gate", "fused_up", "fused_down"
FUSED_KINDS = (FUSED_GATE, FUSED_UP, FUSED_DOWN)


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


def stored_layout(entries: list[tuple[str, tuple, str]], names) -> list[tuple[str, tuple, str]]:
    """``entries`` (:func:`rlflow.models.hf.hf_weight_map`) with the per-expert entries of
    every layer whose files hold the fused tensors (``names``: the tensor names in the
    safetensors files) replaced by entries of the fused kinds."""
    names = set(names)
    fused_layers = set()
    out = []
    for name, ours, kind in entries:
        if kind != EXPERT_LINEAR:
            out.append((name, ours, kind))
            continue
        prefix = name[:name.index("experts.") + len("experts.")]
        if prefix + "gate_up_proj" not in names:
            out.append((name, ours, kind))
        elif prefix not in fused_layers:
            fused_layers.add(prefix)
            mlp = ours[:-2]
            out += [(prefix + "gate_up_proj", mlp + ("gate_kernel",), FUSED_GATE),
                    (prefix + "gate_up_proj", mlp + ("up_kernel",), FUSED_UP),
                    (prefix + "down_proj", mlp + ("down_kernel",), FUSED_DOWN)]
    return out


def fused_hf_shape(kind: str, shape: tuple) -> tuple:
    """The HF shape of a fused tensor holding an rlflow kernel of ``shape`` (``[n, E, F]``
    gate / up, ``[n, F, E]`` down)."""
    if kind == FUSED_DOWN:
        return (shape[0], shape[2], shape[1])
    return (shape[0], 2 * shape[2], shape[1])


def fused_to_ours(kind: str, a: np.ndarray) -> np.ndarray:
    """The rlflow kernel held in a fused HF tensor ``a`` (module doc)."""
    if kind != FUSED_DOWN:
        f = a.shape[1] // 2
        a = a[:, :f] if kind == FUSED_GATE else a[:, f:]
    return np.ascontiguousarray(np.swapaxes(a, 1, 2))
