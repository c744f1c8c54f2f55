"""The JetStream engine: parity with transformers, logprobs vs a full recompute, sharding,
JetStream API plumbing (ResultTokens layout, tokenizer, stop ids)."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlflow.config import MeshConfig, ModelConfig, SamplerConfig
from rlflow.mesh import make_mesh
from rlflow.models import build_model, load_hf, positions_from_mask
from rlflow.models.logprobs import token_logprobs
from rlflow.sampler.batching import ContinuousBatcher, Request
from rlflow.sampler import kernel_layout, layer_storage
from rlflow.sampler.engine import PromptError, RlflowEngine
from rlflow.sampler.sampling import SamplingParams
from tests.hf_fixtures import FAMILIES, make_tiny_hf_model
from tolerances import forward_atol

PROMPTS = [[1, 17, 42], [1, 5, 9, 200, 31, 77, 4, 8, 100, 12, 6], [1], [9, 8, 7, 6, 5, 4, 3 + 10]]


def one_device_mesh():
    return make_mesh(MeshConfig(), jax.devices()[:1])


def sampler_cfg(**kw):
    base = dict(num_slots=4, max_prefill_length=16, prefill_buckets=(8, 16), max_tokens=8,
                temperature=0.0)
    base.update(kw)
    return SamplerConfig(**base)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """(family, k) -> (HF folder, rlflow model, engine with k decode steps per call); one
    model per family and one engine per (family, k) for the module."""
    models, engines = {}, {}

    def get(family, k=1):
        if family not in models:
            path = make_tiny_hf_model(family, str(tmp_path_factory.mktemp(family)))
            models[family] = (path, *load_hf(path))
        if (family, k) not in engines:
            path, model, cfg = models[family]
            engines[family, k] = (path, model, cfg, RlflowEngine(
                model, sampler_cfg(decode_steps_per_call=k), mesh=one_device_mesh()))
        return engines[family, k]
    return get


@functools.lru_cache(maxsize=None)
def _hf_model(path):
    """The transformers model of an HF folder, loaded once per folder for the module."""
    import torch
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def _hf_greedy(path, prompt, max_new_tokens):
    import torch
    model = _hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), do_sample=False, max_new_tokens=max_new_tokens)
    return tuple(out[0, len(prompt):].tolist()), model.generation_config


def hf_greedy(path, prompt, max_new_tokens):
    """transformers' greedy ``generate`` of ``prompt``: (new tokens, generation config);
    computed once per (folder, prompt, length) for the module (the k = 1 and k = 3 cases
    compare against the same reference)."""
    tokens, gen_cfg = _hf_greedy(path, tuple(prompt), max_new_tokens)
    return list(tokens), gen_cfg


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_generate(hf_models, family, k):
    """k decode steps per call: same greedy tokens (a slot ending mid-call stops there)."""
    path, model, cfg, engine = hf_models(family, k)
    assert set(cfg.eos_token_ids) == {2, 3}
    batcher = ContinuousBatcher(engine)
    # Four prompts of different lengths (1 to 11 tokens, two buckets) decode together.
    groups = {g.prompt_id: g for g in batcher.run(
        [Request(i, p, 1, SamplingParams(temperature=0.0, max_tokens=8))
         for i, p in enumerate(PROMPTS)])}
    assert batcher.counters.decode_steps < sum(len(g.completions[0].tokens) for g in
                                               groups.values())      # they shared steps
    assert batcher.counters.decode_steps == k * batcher.counters.decode_calls
    for i, prompt in enumerate(PROMPTS):
        ours = groups[i].completions[0]
        ref, gen_cfg = hf_greedy(path, prompt, 8)
        n = len(ours.tokens)
        assert ours.tokens.tolist() == ref[:n], (family, i, ours.tokens, ref)
        if ours.finish_reason == "stop":
            assert ref[n - 1] in (2, 3) and all(t == gen_cfg.pad_token_id for t in ref[n:])
        else:
            assert n == 8 and not set(ref) & {2, 3}


def recompute_logprobs(model, prompt_tokens, completions, temperature):
    """Learner-style: one full forward over the right-padded batch prompt+completion."""
    seqs = [np.concatenate([prompt_tokens, c]) for c in completions]
    t = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), t), np.int32)
    mask = np.zeros((len(seqs), t), bool)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)], mask[i, :len(s)] = s, True
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda st, *a: nnx.merge(graphdef, st)(*a))
    logits = forward(state, jnp.asarray(tokens), positions_from_mask(mask), jnp.asarray(mask))
    lp = np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(tokens[:, 1:]), temperature))
    p = len(prompt_tokens)
    return [lp[i, p - 1:p - 1 + len(c)] for i, c in enumerate(completions)]


@pytest.mark.parametrize("temperature,k", [(0.7, 1), (1.0, 1), (1.0, 3)])
def test_sampled_logprobs_equal_full_recompute(hf_models, temperature, k):
    _, model, _, engine = hf_models("qwen2", k)
    batcher = ContinuousBatcher(engine)
    reqs = [Request(i, p, 3, SamplingParams(temperature=temperature, max_tokens=8, seed=10 + i))
            for i, p in enumerate(PROMPTS[:2])]
    groups = batcher.run(reqs)
    assert len(groups) == 2
    for g in groups:
        comps = [c.tokens for c in g.completions]
        assert len({tuple(c) for c in comps}) > 1, "samples of a group should differ"
        ref = recompute_logprobs(model, np.asarray(g.request.prompt_tokens), comps, temperature)
        for c, r in zip(g.completions, ref):
            # engine decode vs a full recompute: two programs (tests/tolerances.py)
            seq = len(g.request.prompt_tokens) + 8
            np.testing.assert_allclose(c.logprobs, r, rtol=0,
                                       atol=forward_atol(model.cfg, seq, np.abs(r).max()))
            assert (c.versions == 0).all()


def random_model(scale=1.0, **kw):
    """A random tiny model; ``scale`` > 1 sharpens its logits (a non-constant greedy path)."""
    model = build_model(ModelConfig(hidden_size=64, num_layers=2, vocab_size=128, **kw))[0]
    if scale != 1.0:
        nnx.update(model, jax.tree_util.tree_map(lambda x: x * scale,
                                                 nnx.state(model, nnx.Param)))
    return model


@pytest.mark.parametrize("mesh_name,mesh_cfg", [
    ("data2xtensor2", MeshConfig(data=2, tensor=2)),
    # 2 KV heads on a tensor axis of 4: the cache is replicated, the weights still split.
    pytest.param("tensor4", MeshConfig(tensor=4), marks=pytest.mark.slow)])
def test_sharded_engine_matches_single_device(mesh_name, mesh_cfg):
    model = random_model(scale=6.0, init_seed=3)
    reqs = [Request(i, p, 1, SamplingParams(temperature=0.0, max_tokens=6))
            for i, p in enumerate([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]])]
    sampled = [Request(10, [5, 6, 7], 2, SamplingParams(temperature=1.0, max_tokens=6, seed=4))]
    results = {}
    for name, mesh in [("1", one_device_mesh()), (mesh_name, make_mesh(mesh_cfg, jax.devices()))]:
        engine = RlflowEngine(model, sampler_cfg(), mesh=mesh)
        groups = ContinuousBatcher(engine).run(reqs + sampled)
        results[name] = {g.prompt_id: g for g in groups}
    base = results["1"]
    assert len({tuple(base[i].completions[0].tokens) for i in range(3)}) > 1
    assert results[mesh_name].keys() == base.keys()
    for pid, g in results[mesh_name].items():
        for c, ref in zip(g.completions, base[pid].completions):
            assert c.tokens.tolist() == ref.tokens.tolist(), (mesh_name, pid)
            # sharded vs one device: two programs (tests/tolerances.py)
            np.testing.assert_allclose(c.logprobs, ref.logprobs, rtol=0, atol=forward_atol(
                model.cfg, 16, float(np.abs(ref.logprobs).max())))


@pytest.mark.parametrize("tie", [True, False])
def test_kernel_layouts_give_the_same_completions(tie):
    """sampler.kernel_layout: "out_in" stores the wide kernels transposed (gate/up [F, E],
    an untied LM head [V, E]) and decodes the same tokens as "in_out", logprobs within two
    float32 programs' bound; param_state gives the model's own tree back."""
    model = random_model(scale=6.0, init_seed=3, tie_word_embeddings=tie, intermediate_size=96)
    e, f, v, n = (model.cfg.hidden_size, model.cfg.intermediate_size, model.cfg.vocab_size,
                  model.cfg.num_layers)
    reqs = [Request(i, p, 1, SamplingParams(temperature=0.0, max_tokens=6))
            for i, p in enumerate([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]])]
    reqs.append(Request(10, [5, 6, 7], 2, SamplingParams(temperature=1.0, max_tokens=6, seed=4)))
    plain = nnx.state(model, nnx.Param)
    results = {}
    for layout in ("in_out", "out_in"):
        engine = RlflowEngine(model, sampler_cfg(kernel_layout=layout), mesh=one_device_mesh())
        params = engine.load_params()
        shapes = collections.Counter(x.shape for x in params.leaves if x.ndim == 2)
        flipped = layout == "out_in"
        # gate and up [E, F] (wide), down [F, E]; embed [V, E]; an untied head [E, V] (wide)
        want = collections.Counter({(e, f): 0 if flipped else 2 * n,
                                    (f, e): 3 * n if flipped else n,
                                    (v, e): 1 if tie else (1 + flipped),
                                    (e, v): 0 if tie or flipped else 1})
        assert shapes == +want, (layout, shapes)
        for a, b in zip(jax.tree.leaves(engine.param_state(params)), jax.tree.leaves(plain)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if flipped:  # the same arrays again (a LoRA forward swap shares its base): kept
            again = engine.load_params(plain, version=1)
            # positions in the engine's leaves: its view holds one array per layer
            view = nnx.state(layer_storage.unstacked_view(model), nnx.Param)
            assert len(kernel_layout.wide_kernels(view)) == (2 * n + (not tie))
            for i, _, _ in kernel_layout.wide_kernels(view):
                assert again.leaves[i] is params.leaves[i]
            # ... and new arrays (the next version) are stored anew, not served stale
            doubled = jax.tree.map(lambda x: x * 2, plain)
            got = engine.param_state(engine.load_params(doubled, version=2))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(doubled)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        results[layout] = {g.prompt_id: g for g in ContinuousBatcher(engine).run(reqs)}
    base = results["in_out"]
    assert len({tuple(base[i].completions[0].tokens) for i in range(3)}) > 1
    for pid, g in results["out_in"].items():
        for c, ref in zip(g.completions, base[pid].completions):
            assert c.tokens.tolist() == ref.tokens.tolist(), pid
            np.testing.assert_allclose(c.logprobs, ref.logprobs, rtol=0, atol=forward_atol(
                model.cfg, 16, float(np.abs(ref.logprobs).max())))


def test_kernel_layout_auto_follows_the_backend():
    assert kernel_layout.stores_out_first("auto", "cpu")
    assert not kernel_layout.stores_out_first("auto", "tpu")
    assert kernel_layout.stores_out_first("out_in", "tpu")
    assert not kernel_layout.stores_out_first("in_out", "cpu")
    with pytest.raises(ValueError, match="sampler.kernel_layout"):
        kernel_layout.stores_out_first("rows", "cpu")


def test_result_tokens_layout_and_slot_api():
    model = random_model()
    engine = RlflowEngine(model, sampler_cfg(num_slots=2), mesh=one_device_mesh())
    assert engine.max_concurrent_decodes == 2 and engine.samples_per_slot == 1
    assert engine.max_prefill_length == 16
    params = engine.load_params(version=4)
    state = engine.init_decode_state()
    padded, n = engine.pad_prompt([1, 2, 3, 4, 5])
    assert padded.shape == (8,) and n == 5 and (padded[5:] == 0).all()
    prefix = engine.prefill(params=params, padded_tokens=padded, true_length=n)
    state = engine.insert(prefix, state, 1)
    state, result = engine.generate(params, state)
    result = result.convert_to_numpy()
    assert result.data.shape == (2, 3)
    free, busy = result.get_result_at_slot(0), result.get_result_at_slot(1)
    assert int(free.valid[0, 0]) == 0 and int(busy.valid[0, 0]) == 1
    assert int(busy.lengths[0]) == 1 and int(free.lengths[0]) == 0
    assert int(result.versions[1]) == 4
    # Its token and logprob are the greedy next token of a full forward of the prompt.
    logits = nnx.jit(lambda m, *a: m(*a))(model, jnp.asarray([[1, 2, 3, 4, 5]]),
                                           jnp.arange(5)[None], jnp.ones((1, 5), bool))
    assert int(busy.tokens[0, 0]) == int(jnp.argmax(logits[0, -1]))
    want = jax.nn.log_softmax(logits[0, -1])[int(busy.tokens[0, 0])]
    np.testing.assert_allclose(result.logprobs[1], want, rtol=0,
                               atol=forward_atol(model.cfg, 5, float(np.abs(logits).max())))
    with pytest.raises(PromptError, match="not a prefill bucket"):
        engine.prefill(params=params, padded_tokens=np.zeros(5, np.int32), true_length=3)
    with pytest.raises(NotImplementedError):
        engine.prefill(params=params, existing_prefix=prefix, padded_tokens=padded, true_length=n)
    with pytest.raises(ValueError, match="slot 2"):
        engine.insert(prefix, state, 2)


def make_tokenizer_folder(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<|im_end|>": 3}
    vocab.update({f"w{i}": i for i in range(4, 128)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(path)
    GenerationConfig(eos_token_id=[2, 3], bos_token_id=1).save_pretrained(path)
    return str(path)


def test_tokenizer_and_all_eos_ids(tmp_path):
    path = make_tokenizer_folder(tmp_path)
    engine = RlflowEngine(random_model(), sampler_cfg(), mesh=one_device_mesh(),
                          tokenizer_path=path)
    tok = engine.build_tokenizer(engine.get_tokenizer())
    ids, n = tok.encode("w5 w6 w100", add_special_tokens=False)
    assert ids.tolist() == [5, 6, 100] and n == 3
    assert tok.decode([5, 6]) == "w5 w6"
    assert tok.eos_id == 2 and tok.pad_id == 0 and tok.bos_id == 1
    assert tok.stop_tokens == {2, 3}     # generation_config's list, not only the tokenizer's


def test_batched_prefill_and_insert_equal_one_at_a_time():
    """prefill_batch + insert_batch (the batching loop's path) put the same state in the
    same slots as JetStream's one-prompt prefill + insert: the next 4 sampled tokens and
    their logprobs agree, slot by slot (rows padded to a power of two change nothing)."""
    engine = RlflowEngine(random_model(), sampler_cfg(temperature=1.0, decode_steps_per_call=1),
                          mesh=one_device_mesh())
    params = engine.load_params()
    prompts = [[1, 17, 42], [1, 5, 9, 100, 31, 77, 4], [7]]          # one bucket (8)
    sps = [SamplingParams(temperature=t, max_tokens=8, seed=s, stop_token_ids=())
           for t, s in ((1.0, 3), (0.7, 4), (1.3, 5))]
    padded = [engine.pad_prompt(p) for p in prompts]
    # Rows 0, 1, 2 -> slots 2, 0, 3; row 1 also as sample 1 of its request in slot 1.
    rows, slots, index = [0, 1, 2, 1], [2, 0, 3, 1], [0, 0, 0, 1]

    def decode(state, steps=4):              # one token per call (k = 1)
        out = []
        for _ in range(steps):
            state, packed = engine.generate_packed(params, state)
            out.append(np.asarray(packed)[0])
        return np.stack(out)                                          # [steps, slots, 6]

    prefix = engine.prefill_batch(params, [p for p, _ in padded], [n for _, n in padded], sps)
    assert prefix.cache.k[0].shape[0] == 4                            # 3 rows padded to 4
    batched = decode(engine.insert_batch(prefix, engine.init_decode_state(), rows, slots,
                                         index))
    state = engine.init_decode_state()
    for r, s, i in zip(rows, slots, index):
        one = engine.prefill(params=params, padded_tokens=padded[r][0],
                             true_length=padded[r][1], sampling=sps[r], sample_index=i)
        state = engine.insert(one, state, s)
    single = decode(state)
    np.testing.assert_array_equal(batched[..., :5], single[..., :5])  # token, valid, ..
    np.testing.assert_allclose(batched[..., 5].view(np.float32),
                               single[..., 5].view(np.float32), atol=1e-5)
    assert (batched[:, :, 1] == 1).all()
    # Sample 1 of the request in slot 1 draws its own tokens, not sample 0's (slot 0).
    assert batched[:, 1, 0].tolist() != batched[:, 0, 0].tolist()
    with pytest.raises(ValueError, match=r"rows \[0, 9\] must be in \[0, 4\)"):
        engine.insert_batch(prefix, engine.init_decode_state(), [0, 9], [0, 1], [0, 0])
    with pytest.raises(ValueError, match="distinct"):
        engine.insert_batch(prefix, engine.init_decode_state(), [0, 1], [2, 2], [0, 0])
    with pytest.raises(ValueError, match="different buckets"):
        engine.prefill_batch(params, [np.zeros(8, np.int32), np.zeros(16, np.int32)], [2, 2],
                             [None, None])


def test_batching_loop_prefills_each_bucket_once_per_refill():
    """One refill of 4 slots from 3 requests (G = 2, 1, 1; buckets 8, 8, 16): two prefill
    calls (one per bucket), three prompts prefilled, one prefix reused, and one insert call
    per prefill batch."""
    engine = RlflowEngine(random_model(), sampler_cfg(), mesh=one_device_mesh())
    sp = SamplingParams(temperature=0.0, max_tokens=2, stop_token_ids=())
    batcher = ContinuousBatcher(engine)
    for pid, (prompt, g) in enumerate([([1, 2, 3], 2), ([4, 5], 1), (list(range(1, 12)), 1)]):
        batcher.submit(Request(pid, prompt, g, sp))
    batcher.step()
    c = batcher.counters
    assert (c.prefill_calls, c.prefills, c.prefix_reuses, c.insert_calls) == (2, 3, 1, 2)
    groups = batcher.run()
    assert sorted(g.prompt_id for g in groups) == [0, 1, 2]
    assert [len(g.completions) for g in sorted(groups, key=lambda g: g.prompt_id)] == [2, 1, 1]


def test_prefill_and_insert_shapes_stay_bounded():
    """Every compiled variant stalls all slots: over a ragged stream (prompt lengths 1-16,
    G 1-5, 4 slots) prefill and insert see at most log2(max_prefill_batch) + 1 = 3 row
    counts per bucket (1, 2, 4: never 3), and insert one width per row count."""
    engine = RlflowEngine(random_model(), sampler_cfg(num_slots=4, max_prefill_batch=4,
                                                      group_size=2, temperature=1.0),
                          mesh=one_device_mesh())
    seen = {"prefill": set(), "insert": set()}
    prefill, insert = engine._prefill, engine._insert

    def spy_prefill(params, tokens, *rest):
        seen["prefill"].add(tokens.shape)
        return prefill(params, tokens, *rest)

    def spy_insert(prefix, state, rows, slots, index):
        seen["insert"].add((prefix.cache.k[0].shape, rows.shape))
        return insert(prefix, state, rows, slots, index)
    engine._prefill, engine._insert = spy_prefill, spy_insert
    rng = np.random.default_rng(0)
    reqs = [Request(i, rng.integers(1, 128, int(rng.integers(1, 17))).tolist(),
                    int(rng.integers(1, 6)) if i % 4 else 1, SamplingParams(max_tokens=int(rng.integers(1, 5)),
                                                            seed=i, stop_token_ids=()))
            for i in range(40)]
    # First refill: three bucket-8 prompts and one bucket-16 prompt (3 rows -> 4).
    for i, n in enumerate((3, 5, 7, 12)):
        reqs[i] = Request(i, list(range(1, n + 1)), 1, reqs[i].sampling)
    groups = ContinuousBatcher(engine).run(reqs)
    assert sorted(g.prompt_id for g in groups) == list(range(40))
    allowed = {(n, p) for n in (1, 2, 4) for p in (8, 16)}
    assert seen["prefill"] <= allowed
    assert {(k[0], k[2]) for k, _ in seen["insert"]} <= allowed
    assert all(rows == (k[0] * 2,) for k, rows in seen["insert"])   # width = rows x G (2)
    assert len(seen["prefill"]) >= 3                   # the stream did exercise the variants


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_a_sampler_engine_holds_one_copy_of_the_loaded_version(layout):
    """The sampler program's engine (``keep_model_weights=False``) and its pull target keep
    no array of the model they were built from, and a loaded version leaves nothing behind
    beside the engine's leaves: no per-layer slice once transposed ("out_in"), no stacked
    array once sliced. Counted with ``jax.live_arrays`` (what this test creates: the
    difference from its start)."""
    import gc

    from rlflow.sampler.precision import pull_target

    gc.collect()
    start = sum(a.nbytes for a in jax.live_arrays())
    model, _ = build_model(ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=48,
                                       num_layers=3, num_heads=2, num_kv_heads=1,
                                       head_dim=8, init_seed=2))
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    engine = RlflowEngine(model, sampler_cfg(kernel_layout=layout), mesh=one_device_mesh(),
                          keep_model_weights=False)
    target = pull_target(nnx.state(model, nnx.Param), "float32")
    del model
    gc.collect()
    assert sum(a.nbytes for a in jax.live_arrays()) == start        # nothing of the model
    with pytest.raises(ValueError, match="keep_model_weights"):
        engine.load_params()
    version = jax.tree.map(lambda t: jnp.full(t.shape, 0.5, t.dtype), target)
    params = engine.load_params(version, 1)
    del version
    gc.collect()
    held = sum(x.nbytes for x in params.leaves)
    assert held == weights
    assert sum(a.nbytes for a in jax.live_arrays()) - start == held + params.version.nbytes
