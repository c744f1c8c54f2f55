"""Hugging Face interop: logits parity with transformers (torch CPU), export round trip,
sharded checkpoints, tokenizer copy and named errors. Models are tiny, random, built here."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from hf_fixtures import FAMILIES, make_tiny_hf_model
from rlflow.models import ModelFormatError, load_hf, positions_from_mask, save_hf
from tolerances import forward_atol

_forward = nnx.jit(lambda m, t, p, mask: m(t, p, mask))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cache = {}

    def get(family, tie=None):
        key = (family, tie)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{family}_{tie}")
            cache[key] = make_tiny_hf_model(family, str(out), tie=tie)
        return cache[key]
    return get


def _hf_logits(path, seqs, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return [ref(input_ids=torch.tensor(s[None], dtype=torch.long)).logits[0].float().numpy()
                for s in seqs]


def _left_padded(seqs, width):
    toks = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros((len(seqs), width), bool)
    for b, s in enumerate(seqs):
        toks[b, width - len(s):], mask[b, width - len(s):] = s, True
    return jnp.asarray(toks), jnp.asarray(mask)


SEQS = [np.array(s, np.int32) for s in
        ([17, 200, 31, 4, 99, 250, 8, 64, 128], [5, 77, 190, 3, 42], [211, 9])]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_left_padded_batch(hf_dir, family):
    path = hf_dir(family)
    model, cfg = load_hf(path)
    assert cfg.model_type == family and cfg.num_kv_heads < cfg.num_heads
    toks, mask = _left_padded(SEQS, 9)
    ours = np.asarray(_forward(model, toks, positions_from_mask(mask), mask))
    refs = _hf_logits(path, SEQS)
    for b, ref in enumerate(refs):
        got = ours[b, 9 - len(SEQS[b]):]
        assert np.abs(ref).max() > 1.0
        # rlflow vs transformers: two programs (tests/tolerances.py)
        np.testing.assert_allclose(got, ref, rtol=0, err_msg=f"{family} row {b}",
                                   atol=forward_atol(cfg, 9, float(np.abs(ref).max())))


def _config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tie", [True, False])
def test_export_round_trip_through_transformers(hf_dir, tmp_path, family, tie):
    src = hf_dir(family, tie)
    model, cfg = load_hf(src)
    assert cfg.tie_word_embeddings is tie
    assert (model.lm_head is None) is tie
    out = str(tmp_path / "export")
    save_hf(model, cfg, out)
    names = set(load_file(os.path.join(out, "model.safetensors")))
    if tie:
        assert "lm_head.weight" not in names
    else:
        w = load_file(os.path.join(out, "model.safetensors"))
        assert not np.allclose(w["lm_head.weight"], w["model.embed_tokens.weight"])
    c = _config(out)
    assert c["model_type"] == family and c["tie_word_embeddings"] is tie
    assert c["rope_theta"] == cfg.rope_theta and c["num_key_value_heads"] == cfg.num_kv_heads
    assert c["rope_scaling"] == (cfg.rope_scaling if family == "llama" else None)
    if family == "llama":
        assert c["rope_scaling"]["rope_type"] == "llama3" and c["rope_scaling"]["factor"] == 8.0
    with open(os.path.join(out, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [2, 3]
    # float32 weights copied bit for bit and run by the same program: the same logits
    for exported, original in zip(_hf_logits(out, SEQS), _hf_logits(src, SEQS)):
        np.testing.assert_array_equal(exported, original)


def test_export_bfloat16_and_sharded_files(hf_dir, tmp_path):
    from rlflow.models import write_hf

    src = hf_dir("qwen2")
    model, cfg = load_hf(src)
    out = str(tmp_path / "bf16")
    write_hf(nnx.state(model, nnx.Param), cfg, out, dtype="bfloat16", max_shard_bytes=40_000)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) > 1
    assert _config(out)["torch_dtype"] == "bfloat16"
    with safe_open(os.path.join(out, sorted(files)[0]), framework="pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16
    # bf16 rounding of the same weights: close to the fp32 reference, loaded by both sides
    ours_bf16, cfg16 = load_hf(out, dtype="bfloat16", param_dtype="bfloat16")
    assert cfg16.param_dtype == "bfloat16"
    exported = _hf_logits(out, SEQS[:1], dtype=torch.bfloat16)[0]
    original = _hf_logits(src, SEQS[:1])[0]
    assert np.abs(exported - original).max() < 0.05 * np.abs(original).max()
    toks, mask = _left_padded(SEQS[:1], 9)
    ours = np.asarray(_forward(ours_bf16, toks, positions_from_mask(mask), mask))[0]
    assert np.abs(ours - original).max() < 0.05 * np.abs(original).max()


def test_load_transformers_sharded_checkpoint(hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    src = hf_dir("llama")
    sharded = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(sharded, max_shard_size="50KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    a, _ = load_hf(src)
    b, _ = load_hf(sharded)
    for x, y in zip(jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_load_into_mesh_places_each_parameter_in_its_sharding(hf_dir):
    from rlflow.config import MeshConfig
    from rlflow.mesh import make_mesh, param_shardings

    path = hf_dir("qwen3")
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2))
    sharded, cfg = load_hf(path, mesh=mesh)
    plain, _ = load_hf(path)
    ps = nnx.state(sharded, nnx.Param)
    want = jax.tree.leaves(param_shardings(ps, mesh))
    for arr, sh, ref in zip(jax.tree.leaves(ps), want, jax.tree.leaves(nnx.state(plain, nnx.Param))):
        assert arr.sharding == sh
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(ref))
    q = sharded.layers.attn.q_kernel[...]          # stacked [L, E, H, D]: layers unsharded
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (cfg.num_layers, cfg.hidden_size // 2,
                                                  cfg.num_heads // 2, cfg.head_dim)


def test_tokenizer_files_are_copied(hf_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "<unk>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tdir = str(tmp_path / "tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            bos_token="<s>").save_pretrained(tdir)
    model, cfg = load_hf(hf_dir("qwen2"))
    out = str(tmp_path / "out")
    save_hf(model, cfg, out, tokenizer_dir=tdir)
    for name in os.listdir(tdir):
        with open(os.path.join(tdir, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
            assert a.read() == b.read(), name
    # (AutoTokenizer would pick the family's tokenizer class from config.json: load directly)
    assert PreTrainedTokenizerFast.from_pretrained(out)("hello world")["input_ids"] == [3, 4]
    with pytest.raises(ModelFormatError, match="no tokenizer files"):
        save_hf(model, cfg, str(tmp_path / "out2"), tokenizer_dir=str(tmp_path))


# ------------------------------------------------------------------------------ errors
def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return str(dst)


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ModelFormatError, match="no config.json"):
        load_hf(str(tmp_path))
    with pytest.raises(ModelFormatError, match="not a folder"):
        load_hf(str(tmp_path / "nope"))


def test_unsupported_model_type_lists_supported(hf_dir, tmp_path):
    d = _copy(hf_dir("llama"), tmp_path / "m")
    c = _config(d)
    c["model_type"] = "gpt2"
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f)
    with pytest.raises(ModelFormatError,
                       match="unsupported model_type 'gpt2'; supported: llama, qwen2, qwen3"):
        load_hf(d)


def test_missing_tensor_is_named(hf_dir, tmp_path):
    d = _copy(hf_dir("qwen2"), tmp_path / "m")
    f = os.path.join(d, "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match="'model.layers.1.self_attn.k_proj.bias' is missing"):
        load_hf(d)


def test_shape_mismatch_names_tensor_and_shapes(hf_dir, tmp_path):
    d = _copy(hf_dir("llama"), tmp_path / "m")
    c = _config(d)
    c["intermediate_size"] = 80
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f)
    with pytest.raises(ModelFormatError,
                       match=r"'model.layers.0.mlp.gate_proj.weight' has shape \[96, 64\], "
                             r"expected \[80, 64\]"):
        load_hf(d)


def test_out_of_range_token_ids_raise_on_loaded_model(hf_dir):
    from rlflow.models import TokenRangeError

    model, cfg = load_hf(hf_dir("qwen3"))
    toks = jnp.asarray([[1, 2, 300]], jnp.int32)
    with pytest.raises(TokenRangeError, match="token id 300.*vocab_size 256"):
        model(toks, jnp.arange(3)[None], jnp.ones((1, 3), bool))


def test_config_json_layouts_transformers_4_and_5():
    from rlflow.models import DecoderConfig

    base = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, eos_token_id=[2, 3])
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    v4 = DecoderConfig.from_hf_dict({**base, "rope_theta": 5e5,
                                     "rope_scaling": {"type": "llama3", **scaling}})
    v5 = DecoderConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "llama3",
                                                                 "rope_theta": 5e5, **scaling}})
    assert v4 == v5
    assert v4.rope_theta == 5e5 and v4.rope_scaling == {"rope_type": "llama3", **scaling}
    assert v4.head_dim == 16 and v4.eos_token_ids == (2, 3)
    assert v4.tie_word_embeddings is False            # transformers' default when absent
    assert DecoderConfig.from_hf_dict(v4.to_hf_dict()) == v4
    with pytest.raises(ModelFormatError, match="num_hidden_layers: required field is missing"):
        DecoderConfig.from_hf_dict({k: v for k, v in base.items() if k != "num_hidden_layers"})
    with pytest.raises(ModelFormatError, match="use_sliding_window"):
        DecoderConfig.from_hf_dict({**base, "model_type": "qwen2", "use_sliding_window": True})
