"""What an exported Hugging Face folder keeps from the folder it came from.

rlflow writes ``config.json`` from its :class:`rlflow.models.config.DecoderConfig`, which
holds only the architecture it computes with. An export from a source folder (``rlflow
export --model-path``, or ``--run`` with the run's base model) must not lose what the
source says beyond that, nor rewrite it:

* ``config.json``: the keys in :data:`OWNED_CONFIG_KEYS` (the architecture rlflow reads
  and computes with, the layout names and the stored dtype) are rlflow's; every other key
  keeps the source's value, e.g. ``eos_token_id`` stays a scalar when the source had one
  (rlflow's own EOS set also holds the ids of ``generation_config.json``), and
  ``initializer_range``, ``transformers_version`` or a model's custom keys pass through.
  Keys the source lacks come from rlflow.
* ``generation_config.json``: the source's file as it is (``do_sample``, ``temperature``,
  ``top_p``, ``top_k``, ``repetition_penalty``, EOS/pad ids, ...); rlflow owns none of it.
  Without one, rlflow writes its bos / pad / EOS ids.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

# The architecture DecoderConfig reads (from_hf_dict) and the weights depend on, plus the
# stored dtype: rlflow's values win over the source's.
OWNED_CONFIG_KEYS = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "torch_dtype",
    # several layer kinds (rlflow.models.hf_families)
    "layer_types", "sliding_window", "query_pre_attn_scalar", "final_logit_softcapping",
    "hidden_activation", "hidden_act", "num_local_experts", "num_experts_per_tok",
    "swiglu_alpha", "swiglu_limit", "rope_local_base_freq",
})


def merge_config(ours: Mapping[str, Any], source: Optional[Mapping[str, Any]]) -> dict:
    """The ``config.json`` object to write.

    Args:
      ours: :meth:`DecoderConfig.to_hf_dict` of the exported model (with its stored dtype in
        ``torch_dtype``).
      source: the source folder's parsed ``config.json`` (None: no source).

    Returns: ``source`` with every key of :data:`OWNED_CONFIG_KEYS` set to ours, ours filling
    in the keys the source lacks, and a source ``dtype`` key (transformers >= 4.56 spelling)
    set to the stored dtype too.
    """
    if source is None:
        return dict(ours)
    out = dict(source)
    for key, value in ours.items():
        if key in OWNED_CONFIG_KEYS or key not in source:
            out[key] = value
    if "dtype" in source:
        out["dtype"] = ours["torch_dtype"]
    return out


def read_json(path: str) -> Optional[dict]:
    """A JSON object file, or None when the file does not exist."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
