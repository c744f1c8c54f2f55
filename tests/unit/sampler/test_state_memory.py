"""The memory model counts each kind of layer (issue 51): the sampler's decode state of
Qwen3.5 (gated DeltaNet states that do not grow with the length), Gemma 3 and gpt-oss
(sliding-window layers, which hold a ring of their window per slot:
:mod:`rlflow.models.window_cache`) equals the bytes of the arrays
``jax.eval_shape`` of :func:`rlflow.models.kv_cache.init_cache` gives (what the engine
allocates); the parameter count equals the built decoder's (``nnx.eval_shape``: nothing is
allocated). Shapes: transformers' own configs of each family (their defaults: Qwen3.5-27B,
Qwen3.5-35B-A3B, Gemma 3, gpt-oss-20b), fewer layers where a decoder is traced; the
sizes are read both from rlflow's ``DecoderConfig`` and from the config.json alone
(:func:`rlflow.console.hf_sizes.hf_architecture`, the fit check's reader)."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from rlflow.config import ExperimentConfig, SamplerConfig, replace
from rlflow.console.hf_sizes import hf_architecture
from rlflow.models.config import DecoderConfig
from rlflow.models.kv_cache import init_cache
from rlflow.sampler import memory

FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "gemma3_text", "gpt_oss")


def hf_dict(family: str, **changes) -> dict:
    import transformers as tf

    cls = {"qwen3_5_text": tf.Qwen3_5TextConfig, "qwen3_5_moe_text": tf.Qwen3_5MoeTextConfig,
           "gemma3_text": tf.Gemma3TextConfig, "gpt_oss": tf.GptOssConfig}[family]
    d = cls().to_dict()
    if family == "gemma3_text":
        d["sliding_window"] = 16          # shorter than the slots: the window would show
    if "num_hidden_layers" in changes:
        n = changes["num_hidden_layers"]
        d["layer_types"] = d["layer_types"][:n]
    d.update(changes)
    return d


def sizes(family: str, tmp_path, **changes):
    """``(DecoderConfig, Architecture read from the config.json alone)`` of a family."""
    d = hf_dict(family, **changes)
    folder = tmp_path / family
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d))
    arch = hf_architecture(str(folder))
    assert arch is not None
    return DecoderConfig.from_hf_dict(d, dtype="bfloat16", param_dtype="bfloat16"), arch


def experiment(slots: int, prompt: int, new: int):
    return replace(ExperimentConfig(), sampler=SamplerConfig(
        num_slots=slots, max_prefill_length=prompt, prefill_buckets=(prompt,), max_tokens=new,
        dtype="bfloat16"))


def allocated(dcfg, slots: int, length: int) -> int:
    """Bytes of the keys, values and gated DeltaNet states ``init_cache`` allocates."""
    cache = jax.eval_shape(lambda: init_cache(dcfg, slots, length))
    leaves = jax.tree.leaves((cache.k, cache.v, cache.linear))
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in leaves)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_state_bytes_are_those_the_engine_allocates(family, tmp_path):
    dcfg, arch = sizes(family, tmp_path)
    linear = dcfg.kinds.count("linear_attention")
    assert arch.kinds == dcfg.kinds and (linear > 0) == family.startswith("qwen3_5")
    assert ("sliding_attention" in dcfg.kinds) == (family in ("gemma3_text", "gpt_oss"))
    got = {}
    for prompt, new in ((8, 24), (16, 112)):                # 32 and 128 positions a slot
        cfg = experiment(3, prompt, new)
        want = allocated(dcfg, 3, prompt + new)
        assert memory.kv_cache_bytes(cfg, dcfg) == memory.kv_cache_bytes(cfg, arch) == want
        got[prompt + new] = want
    # 96 more positions a slot: keys and values of the full-attention layers, and of the
    # sliding-window layers up to their window (a ring of min(window, S) positions)
    attn = dcfg.num_layers - linear
    full = dcfg.kinds.count("full_attention")
    window = dcfg.sliding_window or 0
    ring = lambda length: min(window, length)      # noqa: E731
    sliding_growth = dcfg.kinds.count("sliding_attention") * (ring(128) - ring(32))
    assert got[128] - got[32] == 3 * (96 * full + sliding_growth) * 2 * dcfg.num_kv_heads * \
        dcfg.head_dim * 2
    if linear:         # the DeltaNet states: conv windows bf16 + [Hv, dk, dv] float32
        g = dcfg.gdn
        state = (3 * (2 * g["num_k_heads"] * g["head_k_dim"] + g["num_v_heads"] *
                      g["head_v_dim"]) * 2 + 4 * g["num_v_heads"] * g["head_k_dim"] *
                 g["head_v_dim"])
        assert got[32] == 3 * 32 * attn * 2 * dcfg.num_kv_heads * dcfg.head_dim * 2 + \
            3 * linear * state


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_count_equals_the_built_decoder(family, tmp_path):
    """Exact for Qwen3.5 / Qwen3.5-MoE (DeltaNet layers, output gate, shared expert);
    Gemma's extra norms and gpt-oss's biases and sinks are left out (module doc of
    rlflow.console.hf_sizes): within 0.1%."""
    from rlflow.models.decoder import Decoder

    dcfg, arch = sizes(family, tmp_path, num_hidden_layers=5, vocab_size=1024)
    model = nnx.eval_shape(lambda: Decoder(dcfg, rngs=nnx.Rngs(0)))
    real = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if family.startswith("qwen3_5"):
        assert arch.num_params() == real
    else:
        assert 0 < real - arch.num_params() <= 1e-3 * real


def test_fit_counts_the_hybrids_state_not_the_dense_caches(tmp_path):
    """A Qwen3.5 sampler replica at 32K tokens a slot: the fit check's KV term is the hybrid's
    (10 growing layers of 40), a quarter of the growth of a dense model of the same depth."""
    from rlflow.sampler.memory import sampler_bytes

    _, arch = sizes("qwen3_5_moe_text", tmp_path)
    dense = replace(arch, layer_types=(), gdn=None)
    short, long = experiment(8, 1024, 1024), experiment(8, 1024, 31744)
    grow = lambda a: sampler_bytes(long, a) - sampler_bytes(short, a)   # noqa: E731
    assert grow(arch) * 4 == grow(dense)
