"""Hugging Face tensor names of a Qwen3-MoE layer's MLP (:class:`rlflow.models.moe.MoE`).

On disk (``Qwen3MoeForCausalLM.save_pretrained``, transformers 4.x and 5.x alike; 5.x fuses
the experts in memory only, through its ``conversion_mapping``), layer ``i`` holds

* ``model.layers.{i}.mlp.gate.weight`` ``[n, E]``: the router, rlflow ``router [E, n]``;
* ``model.layers.{i}.mlp.experts.{j}.{gate,up}_proj.weight`` ``[F, E]`` and
  ``...experts.{j}.down_proj.weight`` ``[E, F]`` for each expert ``j``: slice ``j`` of
  rlflow's ``gate_kernel`` / ``up_kernel`` ``[n, E, F]`` and ``down_kernel`` ``[n, F, E]``,
  transposed.

Expert entries have the kind :data:`EXPERT_LINEAR` and sit at index ``(i, j)`` of the stacked
kernel ``[L, n, ...]`` (layer ``i``, expert ``j``), which :mod:`rlflow.models.hf` reads and
writes slice by slice.

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


def moe_layer_tensors(num_experts: int) -> list[tuple[str, tuple, str, tuple]]:
    """``(hf name inside model.layers.{i}., path inside a Block, kind, at)`` of one layer's
    MoE MLP (module doc; :class:`rlflow.models.hf.LayerTensor`'s fields): the router, and
    expert ``j``'s projections at index ``(j,)`` of their ``[n, ...]`` kernels."""
    m = [("mlp.gate.weight", ("mlp", "router"), "linear", ())]
    for p in ("gate", "up", "down"):
        m += [(f"mlp.experts.{j}.{p}_proj.weight", ("mlp", f"{p}_kernel"), EXPERT_LINEAR, (j,))
              for j in range(num_experts)]
    return m


# gpt-oss: HF [.., 2F] with gate in the even columns, up in the odd -> rlflow [.., F] each
GATE_EVEN, UP_ODD = "interleaved_even", "interleaved_odd"
INTERLEAVED_KINDS = (GATE_EVEN, UP_ODD)


def gpt_oss_layer_tensors() -> list[tuple[str, tuple, str, tuple]]:
    """One gpt-oss layer's MoE tensors (``GptOssForCausalLM.save_pretrained``, transformers
    5.x), as :func:`moe_layer_tensors`: the router ``mlp.router.weight [n, E]`` and
    ``.bias [n]``; the experts fused, ``[in, out]``: ``mlp.experts.gate_up_proj [n, E, 2F]``
    (gate the even columns, up the odd) and its ``_bias [n, 2F]``, ``mlp.experts.down_proj
    [n, F, E]`` and its ``_bias [n, E]``."""
    mlp = "mlp"
    return [("mlp.router.weight", (mlp, "router"), "linear", ()),
            ("mlp.router.bias", (mlp, "router_bias"), "copy", ()),
            ("mlp.experts.gate_up_proj", (mlp, "gate_kernel"), GATE_EVEN, ()),
            ("mlp.experts.gate_up_proj", (mlp, "up_kernel"), UP_ODD, ()),
            ("mlp.experts.gate_up_proj_bias", (mlp, "gate_bias"), GATE_EVEN, ()),
            ("mlp.experts.gate_up_proj_bias", (mlp, "up_bias"), UP_ODD, ()),
            ("mlp.experts.down_proj", (mlp, "down_kernel"), "copy", ()),
            ("mlp.experts.down_proj_bias", (mlp, "down_bias"), "copy", ())]


def stored_layout(entries: list, names) -> list:
    """``entries`` (:func:`rlflow.models.hf.hf_weight_map`'s ``HfTensor`` list) with the
    per-expert entries of every layer whose files hold the fused tensors (``names``: the
    tensor names in the safetensors files) replaced by entries of the fused kinds (one per
    kernel, at the layer's index of the stacked ``[L, n, ...]`` kernel)."""
    names = set(names)
    fused_layers = set()
    out = []
    for t in entries:
        if t.kind != EXPERT_LINEAR:
            out.append(t)
            continue
        prefix = t.name[:t.name.index("experts.") + len("experts.")]
        if prefix + "gate_up_proj" not in names:
            out.append(t)
        elif prefix not in fused_layers:
            fused_layers.add(prefix)
            mlp, layer = t.path[:-1], t.index[:1]
            out += [t._replace(name=prefix + "gate_up_proj", path=mlp + ("gate_kernel",),
                               kind=FUSED_GATE, index=layer),
                    t._replace(name=prefix + "gate_up_proj", path=mlp + ("up_kernel",),
                               kind=FUSED_UP, index=layer),
                    t._replace(name=prefix + "down_proj", path=mlp + ("down_kernel",),
                               kind=FUSED_DOWN, index=layer)]
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
