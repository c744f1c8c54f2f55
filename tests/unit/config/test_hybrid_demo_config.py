"""configs/hybrid_demo.py: a random Qwen3.5 text model (three gated DeltaNet layers and one
gated full-attention layer) written as a HF folder that transformers reads with the same
logits as rlflow; the contiguous cache and plain packing the hybrid layers need."""

import os

import jax.numpy as jnp
import numpy as np

from rlflow.config import load_config_file
from tolerances import forward_atol

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
HYBRID = os.path.join(REPO, "configs", "hybrid_demo.py")


def test_hybrid_demo_model_loads_in_transformers_with_rlflows_logits(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlflow.models import load_hf, positions_from_mask

    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path))
    cfg = load_config_file(HYBRID)
    assert cfg.sampler.kv_cache == "contiguous" and not cfg.learner.shared_prefix
    path = cfg.model.path
    assert os.path.dirname(path) == str(tmp_path)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".hybrid-demo-model-")]
    model, mcfg = load_hf(path)
    assert mcfg.kinds == ("linear_attention",) * 3 + ("full_attention",)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("7>", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits[0]
    ones = jnp.ones(ids.shape, bool)
    ours = np.asarray(model(jnp.asarray(ids.numpy()), positions_from_mask(ones), ones))[0]
    scale = float(np.abs(ref.numpy()).max())
    assert scale > 0.01
    # rlflow vs transformers: two float32 programs (tests/tolerances.py)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=0,
                               atol=forward_atol(mcfg, ids.shape[1], scale))
