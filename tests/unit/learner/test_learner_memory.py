"""Learner memory per chip (rlflow.learner.memory) against real models and a real sharded
learner state, and the 70B reference config's fit check."""

import importlib.util
import os

import jax
import numpy as np
import pytest
from flax import nnx

from rlflow.config import MeshConfig, ModelConfig, replace
from rlflow.learner.memory import Architecture, LearnerDoesNotFit, check_fits, learner_memory
from rlflow.models.hf import build_model
from learner_fixtures import tiny_experiment

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("model_type,tied", [("llama", True), ("llama", False),
                                             ("qwen2", False), ("qwen3", True),
                                             ("qwen3_moe", False)])
def test_parameter_count_equals_the_built_model(model_type, tied):
    m = replace(MODEL, model_type=model_type, tie_word_embeddings=tied)
    params = nnx.split(build_model(m)[0], nnx.Param)[1]
    real = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    assert Architecture.from_model_config(m).num_params() == real


def test_moe_counts_every_expert_in_params_and_the_top_k_in_activations(tmp_path):
    """Expert weights count whole (all n stored and trained); activations and model FLOPs
    count the k experts a token goes through; the HF config.json reader gives the same."""
    import json

    from rlflow.console.fit import hf_architecture
    from rlflow.learner.memory import activation_bytes
    from rlflow.models.config import DecoderConfig
    from rlflow.run.perf import matmul_params

    moe = replace(MODEL, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=16)
    arch = Architecture.from_model_config(moe)
    h, n, f = 32, 8, 16
    dense = replace(MODEL, model_type="qwen3")
    per_layer_mlp = n * (3 * h * f + h)
    assert arch.num_params() == (Architecture.from_model_config(dense).num_params()
                                 + MODEL.num_layers * (per_layer_mlp - 3 * h * 64))
    # a dense model of MLP width k x F with the dispatch's copies and router probabilities
    same_width = Architecture.from_model_config(replace(dense, intermediate_size=2 * f))
    kw = dict(rows=4, seq=16, compute_bytes=4, remat="full")
    extra = 4 * 16 * (2 * 4 * 2 * h + 4 * n)          # tokens x (2 a k h + 4 n), one layer
    assert activation_bytes(arch, **kw) == activation_bytes(same_width, **kw) + extra
    dcfg = DecoderConfig.from_model_config(moe)
    assert matmul_params(dcfg) == matmul_params(DecoderConfig.from_model_config(
        replace(dense, intermediate_size=2 * f))) + MODEL.num_layers * h * n
    folder = tmp_path / "m"
    folder.mkdir()
    d = dcfg.to_hf_dict()
    del d["num_experts"]                              # transformers 5.x writes only this one:
    (folder / "config.json").write_text(json.dumps(d))
    assert hf_architecture(str(folder)) == arch


def test_state_terms_equal_the_sharded_learner_state_on_one_chip():
    """fsdp=2 x tensor=2: bytes of params and AdamW moments on device 0 of a real learner.
    The estimate divides everything by fsdp x tensor; the RMSNorm scales are replicated
    (logical axis 'norm' has no mesh axis), so device 0 holds exactly that much more."""
    from rlflow.learner.trainer import Learner

    cfg = tiny_experiment(MODEL, 4, 6, num_devices=4, mesh=MeshConfig(fsdp=2, tensor=2))
    learner = Learner(cfg)
    dev0 = jax.devices()[0]

    def on_dev0(tree):
        return sum(s.data.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "addressable_shards")
                   and x.ndim for s in x.addressable_shards if s.device == dev0)

    mem = learner_memory(Architecture.from_model_config(MODEL), cfg)
    norms = (2 * MODEL.num_layers + 1) * MODEL.hidden_size * 4          # float32 scales
    assert on_dev0(learner.params) == mem.params + norms * (1 - 1 / 4)
    assert on_dev0(learner.state.opt_state) == mem.optimizer + 2 * norms * (1 - 1 / 4)
    # the float32 accumulator and the micro-batch's gradient (float32 params here)
    assert mem.grads == 2 * mem.params and mem.reference == 0.0
    with_ref = learner_memory(Architecture.from_model_config(MODEL),
                              replace(cfg, learner=replace(cfg.learner, kl_coef=0.1)))
    assert with_ref.reference == mem.params
    # weights go by transfer (the default): the step keeps the published params beside the
    # new ones, one more params-sized term; the orbax fallback's step donates them
    assert cfg.runtime.weight_transfer == "transfer" and mem.published == mem.params
    orbax = learner_memory(Architecture.from_model_config(MODEL),
                           replace(cfg, runtime=replace(cfg.runtime, weight_transfer="orbax")))
    assert orbax.published == 0.0 and orbax.total == mem.total - mem.params
    from rlflow.learner.publish import keeps_params     # the learner's own rule
    assert keeps_params(cfg) and not keeps_params(
        replace(cfg, runtime=replace(cfg.runtime, weight_transfer="orbax")))
    # a bf16 sampler: the server holds the bf16 cast (half the params' bytes) and the step
    # donates its float32 params
    bf16 = replace(cfg, sampler=replace(cfg.sampler, dtype="bfloat16"))
    assert not keeps_params(bf16)
    assert learner_memory(Architecture.from_model_config(MODEL), bf16).published == \
        mem.params / 2


def test_activations_scale_with_rows_per_chip():
    arch = Architecture.from_model_config(MODEL)
    cfg = tiny_experiment(MODEL, 4, 6, num_devices=4, mesh=MeshConfig(fsdp=2, tensor=2))
    one = learner_memory(arch, cfg).activations
    two_micro = learner_memory(arch, replace(cfg, learner=replace(cfg.learner,
                                                                  micro_batches=2)))
    assert two_micro.activations == pytest.approx(one / 2)
    assert one > 0


def load_70b():
    path = os.path.join(REPO, "configs", "gsm8k_llama3_1_70b.py")
    spec = importlib.util.spec_from_file_location("cfg70b", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_70b_reference_prints_its_memory_and_names_a_mesh_too_small(tmp_path, capsys):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    m = load_70b()
    assert m.LLAMA_3_1_70B.num_params() == 70_553_706_496     # Llama-3.1-70B's published count
    cfg = m.config(model_path=str(folder))
    err = capsys.readouterr().err
    assert "gsm8k_llama3_1_70b: learner memory per chip (32 chips): params 8.2, optimizer " \
           "16.4, grads 16.4" in err
    assert cfg.learner.num_devices == 32 and cfg.learner.mesh == MeshConfig(fsdp=16, tensor=2)
    assert check_fits(m.LLAMA_3_1_70B, cfg, m.V5P_CHIP_GIB).total < 0.9 * m.V5P_CHIP_GIB * 2**30
    with pytest.raises(LearnerDoesNotFit, match=r"learner.mesh data=1 x fsdp=8 x tensor=1: "
                                                r"70.6B parameters need per chip params 32.9"):
        m.config(model_path=str(folder), learner_mesh=MeshConfig(fsdp=8))


def test_activation_terms_follow_the_remat_policy():
    """Per token (module doc of rlflow.learner.memory): one more layer adds its whole
    intermediates A without remat, only its residual carry ``a h`` with full remat (and
    offload), carry + projection outputs with dots; full <= dots <= none."""
    from rlflow.learner.memory import activation_bytes

    arch = Architecture.from_model_config(MODEL)
    deeper = Architecture.from_model_config(replace(MODEL, num_layers=MODEL.num_layers + 1))
    rows, seq, a = 2, 64, 4
    h, i, d = MODEL.hidden_size, MODEL.intermediate_size, MODEL.head_dim
    q, kv = MODEL.num_heads, MODEL.num_kv_heads
    layer = a * (4 * h + 4 * i + 2 * (q + 2 * kv) * d) + 8 * q * seq
    working = layer + 3 * a * i         # + the MLP's three i-wide cotangents
    per_layer = {"none": layer, "full": a * h, "offload": a * h,
                 "dots": a * (h + (q + 2 * kv) * d + 2 * h + 2 * i)}
    got = {}
    for remat, kept in per_layer.items():
        got[remat] = activation_bytes(arch, rows=rows, seq=seq, compute_bytes=a, remat=remat)
        extra = activation_bytes(deeper, rows=rows, seq=seq, compute_bytes=a, remat=remat)
        assert extra - got[remat] == pytest.approx(rows * seq * kept), remat
    assert got["full"] == got["offload"] < got["dots"] < got["none"]
    # full remat: the layers' inputs and one layer's working set (larger than the head's
    # logits here: 12 V bytes a token); the head runs when no layer is differentiated
    assert 12 * MODEL.vocab_size < working
    assert got["full"] == pytest.approx(rows * seq * (MODEL.num_layers * a * h + working))
    with pytest.raises(ValueError, match="learner.remat must be one of"):
        activation_bytes(arch, rows=rows, seq=seq, compute_bytes=a, remat="some")


def test_memory_efficient_attention_and_chunked_logits_drop_their_terms():
    from rlflow.learner.memory import activation_bytes

    arch = Architecture.from_model_config(MODEL)
    rows, seq = 2, 64
    kw = dict(rows=rows, seq=seq, compute_bytes=4, remat="none")
    full = activation_bytes(arch, **kw)
    no_scores = activation_bytes(arch, scores_materialised=False, **kw)
    assert full - no_scores == pytest.approx(
        rows * seq * (MODEL.num_layers + 1) * 8 * MODEL.num_heads * seq)   # L kept + working
    # a large vocabulary: the logits, not a layer's working set, are the peak (the two are
    # never live at once: the peak is the larger, on top of the kept layers)
    big = Architecture.from_model_config(replace(MODEL, vocab_size=20_000))
    kept = rows * seq * MODEL.num_layers * (4 * (4 * 32 + 4 * 64 + 2 * 8 * 8) + 8 * 4 * seq)
    working = rows * seq * (4 * (4 * 32 + 4 * 64 + 2 * 8 * 8 + 3 * 64) + 8 * 4 * seq)
    unchunked = activation_bytes(big, **kw)
    assert unchunked == pytest.approx(kept + rows * seq * 12 * 20_000)
    chunk = 16
    chunked = activation_bytes(big, logits_chunk_tokens=chunk, **kw)
    assert chunked == pytest.approx(kept + max(working, chunk * 12 * 20_000))
    # a chunk longer than the micro-batch holds every token's logits
    assert activation_bytes(big, logits_chunk_tokens=10 ** 6, **kw) == unchunked
    # learner_memory passes the config's remat and these keywords through
    cfg = tiny_experiment(MODEL, 4, 6, remat="none")
    assert cfg.learner.attention == "auto"          # never holds [T, T] scores
    scores = learner_memory(arch, cfg, scores_materialised=True)
    assert learner_memory(arch, cfg).activations < scores.activations
    xla = learner_memory(arch, replace(cfg, learner=replace(cfg.learner, attention="xla")))
    assert xla.activations == scores.activations
    unchunked = learner_memory(big, cfg, logits_chunk_tokens=10 ** 6)
    assert learner_memory(big, cfg, logits_chunk_tokens=16).activations < unchunked.activations
    full_remat = learner_memory(arch, replace(cfg, learner=replace(cfg.learner, remat="full")))
    assert full_remat.activations < learner_memory(arch, cfg).activations


def test_sequence_axis_counts_a_chip_s_positions_and_the_gathered_keys_values():
    """``sequence = s`` (context parallelism): a chip keeps ``T / s`` positions of each row
    (every per-token term divided by ``s``; the attention scores still span the whole row)
    plus one layer's all-gathered keys, values and their cotangents over the whole row,
    ``4 a kv d`` per token; the parameters and optimiser state are replicated over it."""
    from rlflow.learner.memory import activation_bytes

    arch = Architecture.from_model_config(MODEL)
    rows, seq, a = 2, 64, 4
    kv_gathered = rows * seq * 4 * a * MODEL.num_kv_heads * MODEL.head_dim
    for remat in ("none", "full"):
        for scores in (False, True):
            kw = dict(rows=rows, seq=seq, compute_bytes=a, remat=remat,
                      scores_materialised=scores)
            one = activation_bytes(arch, **kw)
            for s in (2, 4):
                split = activation_bytes(arch, sequence=s, **kw)
                assert split == pytest.approx(one / s + kv_gathered), (remat, scores, s)
    cfg = tiny_experiment(MODEL, 4, 6, num_devices=2, mesh=MeshConfig(sequence=2))
    one_chip = tiny_experiment(MODEL, 4, 6)
    mem, ref = learner_memory(arch, cfg), learner_memory(arch, one_chip)
    assert mem.params == ref.params and mem.optimizer == ref.optimizer
    assert mem.activations < ref.activations
