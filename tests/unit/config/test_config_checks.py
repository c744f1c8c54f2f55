"""``rlflow train`` refuses a config it cannot run before any program starts (issue 14,
items 5 and 6): cross-field constraints, unknown reward names, missing plugins, data files
and model folders are named by field, with exit code 2 and no run folder."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rlflow.console import cli
from rlflow.control import programs_common as pc
from rlflow.config import ConfigError, ExperimentConfig, RewardConfig
from rlflow.console.checks import check_runnable

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@pytest.fixture
def no_programs(monkeypatch, tmp_path):
    """rlflow train may not get as far as starting the programs."""
    import rlflow.launcher.supervisor

    def refuse(cfg):
        raise AssertionError("rlflow train started the programs")

    monkeypatch.setattr(rlflow.launcher.supervisor, "run_train", refuse)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _train(args, capsys):
    try:
        code = cli.main(["train", "--run-dir", "runs"] + args)
    except SystemExit as e:          # tyro's report of a __post_init__ ConfigError
        code = e.code
    out = capsys.readouterr()
    return code, " ".join((out.out + out.err).split()).replace("│", "")


@pytest.mark.parametrize("args, field, detail", [
    (["--sampler.group-size", "1"], "sampler.group_size", "must be >= 2 with learner.advantage"),
    (["--sampler.group-size", "1", "--learner.advantage", "rloo"], "sampler.group_size",
     "'rloo'"),
    (["--reward.functions", "nope", "--reward.weights", "1.0"], "reward.functions",
     # (other test files register functions of their own in the same process)
     "unknown reward function 'nope'; registered: ["),
    (["--reward.functions", "no_such_module:fn", "--reward.weights", "1.0"],
     "reward.functions", "cannot import module 'no_such_module'"),
    (["--data.source", "jsonl", "--data.path", "missing/train.jsonl"], "data.path",
     "no file matches 'missing/train.jsonl'"),
    (["--data.task", "nope"], "data.task", "unknown built-in task 'nope'"),
    (["--plugins", "no_such_plugin"], "plugins", "cannot import module 'no_such_plugin'"),
    (["--model.path", "nowhere"], "model.path", "must be an existing Hugging Face folder"),
    (["--learner.num-devices", "2", "--learner.mesh.fsdp", "2"], "runtime.transfer_layout",
     "needs at least learner.num_devices=2 sampler devices, got sampler.num_devices=1"),
    (["--data.max-prompt-tokens", "100"], "data.max_prompt_tokens",
     "100 is above sampler.max_prefill_length=8, so prompts of 9-100 tokens would pass the "
     "data filter and stop the sampler"),
    (["--data.max-prompt-tokens", "9"], "data.max_prompt_tokens",
     "9 is above sampler.max_prefill_length=8, so prompts of 9 tokens would pass"),
    # ~16 TB of KV cache for the demo model: more than any machine this runs on
    (["--sampler.max-tokens", "1000000000"], "sampler.max_tokens",
     "a sampler's KV cache would take"),
])
def test_train_refuses_before_starting_anything(no_programs, capsys, args, field, detail):
    code, text = _train(args, capsys)
    assert code == 2
    assert f"{field}:" in text and " ".join(detail.split()) in text, text
    assert not os.path.exists(no_programs / "runs")


def test_model_folder_without_weights_or_tokenizer_is_refused(no_programs, capsys):
    folder = no_programs / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    code, text = _train(["--model.path", str(folder)], capsys)
    assert code == 2 and "model.path:" in text and "no *.safetensors" in text, text
    (folder / "model.safetensors").write_bytes(b"")
    code, text = _train(["--model.path", str(folder)], capsys)
    assert code == 2 and "model.path:" in text and "no tokenizer files" in text, text


@pytest.mark.parametrize("files", [
    {"tokenizer_config.json": '{"tokenizer_class": "LlamaTokenizer"}'},     # no vocab file
    {"tokenizer_config.json": "{}", "tokenizer.model": ""},               # empty sentencepiece
    {"tokenizer.json": "{not json"},                                      # broken fast file
])
def test_a_model_folder_whose_tokenizer_cannot_be_built_is_refused_in_one_line(
        no_programs, capsys, files):
    """Issue 39.3: a folder with a tokenizer file's name but no usable tokenizer passed the
    pre-start checks and the sampler died with a transformers traceback. The check builds
    the tokenizer as the programs do and names the folder and the files expected."""
    folder = no_programs / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_LLAMA))
    (folder / "model.safetensors").write_bytes(b"")
    for name, body in files.items():
        (folder / name).write_text(body)
    code, text = _train(["--model.path", str(folder)], capsys)
    assert code == 2, text
    assert (f"model.path: cannot build the tokenizer of '{folder}' as the programs do ("
            in text or f"model.path: the tokenizer of '{folder}' encodes the prompt" in text), text
    assert "expected tokenizer.json (with tokenizer_config.json)" in text
    assert f"the folder holds {sorted(['config.json'] + list(files))}" in text
    assert "Traceback" not in text


def test_a_chat_template_that_cannot_render_a_user_message_is_refused(no_programs, capsys):
    folder = no_programs / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_LLAMA))
    (folder / "model.safetensors").write_bytes(b"")
    _word_tokenizer(folder, 100)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{{ raise_exception('only system messages') }}"}))
    (no_programs / "train.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    code, text = _train(["--model.path", str(folder), "--data.source", "jsonl", "--data.path",
                         "train.jsonl", "--data.chat-template", "hf"], capsys)
    assert code == 2 and (f"data.chat_template: the chat template of '{folder}' cannot render "
                          f"a user message (") in text and "only system messages" in text, text


def test_a_folder_as_data_path_is_refused(no_programs, capsys):
    (no_programs / "data").mkdir()
    code, text = _train(["--data.source", "jsonl", "--data.path", "data"], capsys)
    assert code == 2 and "data.path: no file matches 'data' (data is a folder" in text, text
    code, text = _train(["--data.source", "jsonl", "--data.path", "d*"], capsys)
    assert code == 2 and "data.path: no file matches 'd*' (data is a folder" in text, text


HF_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
            "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16, "num_hidden_layers": 1, "vocab_size": 128, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "max_position_embeddings": 64,
            "tie_word_embeddings": False}


def _word_tokenizer(folder, n):
    """A ``tokenizer.json`` of ``n`` tokens (ids 0..n-1) in ``folder``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0")).save(
        str(folder / "tokenizer.json"))


def test_an_unsupported_architecture_or_a_tokenizer_past_the_vocabulary_is_refused(
        no_programs, capsys):
    """config.json's model_type must be one rlflow builds, and the tokenizer's largest id
    must have an embedding row (a larger vocabulary, the padded case, is fine)."""
    folder = no_programs / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    _word_tokenizer(folder, 129)
    (folder / "config.json").write_text(json.dumps(dict(HF_LLAMA, model_type="mistral")))
    code, text = _train(["--model.path", str(folder)], capsys)
    assert code == 2 and "model.path:" in text and "unsupported model_type 'mistral'" in text, \
        text
    (folder / "config.json").write_text(json.dumps(HF_LLAMA))
    code, text = _train(["--model.path", str(folder)], capsys)
    assert code == 2 and (f"model.path: the tokenizer of '{folder}' has ids up to 128, but the "
                          f"model's vocab_size is 128 (config.json)") in text, text
    from rlflow.console.checks import tokenizer_id_count
    _word_tokenizer(folder, 100)
    assert tokenizer_id_count(str(folder)) == 100
    from rlflow.config import ModelConfig
    import numpy as np
    from safetensors.numpy import save_file
    # the weights' headers are checked too (tests/e2e/test_weight_files.py): an intact file
    save_file({"x": np.zeros(1, np.float32)}, str(folder / "model.safetensors"))
    check_runnable(ExperimentConfig(model=ModelConfig(path=str(folder))))


def test_hf_chat_template_without_one_in_the_model_folder_is_refused(no_programs, capsys):
    folder = no_programs / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_LLAMA))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    (no_programs / "train.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    args = ["--model.path", str(folder), "--data.source", "jsonl", "--data.path",
            "train.jsonl", "--data.chat-template", "hf"]
    code, text = _train(args, capsys)
    assert code == 2 and "data.chat_template: 'hf' needs the model folder's chat template" \
        in text, text
    from rlflow.console.checks import has_chat_template
    (folder / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert has_chat_template(str(folder))
    (folder / "tokenizer_config.json").write_text('{}')
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    assert has_chat_template(str(folder))


@pytest.mark.parametrize("body, shown", [
    ("raise SystemExit(3)", "SystemExit(3)"),
    ("import sys; sys.exit()", "SystemExit(None)"),
    ("raise GeneratorExit('odd')", "GeneratorExit: odd"),
])
def test_a_plugin_that_exits_is_named_with_exit_code_2(no_programs, capsys, body, shown):
    (no_programs / "plug_exit.py").write_text(body + "\n")
    code, text = _train(["--plugins", "plug_exit.py"], capsys)
    assert code == 2 and "plugins:" in text and "'plug_exit.py'" in text and shown in text, \
        text
    (no_programs / "plug_mod_exit.py").write_text(body + "\n")
    code, text = _train(["--plugins", "plug_mod_exit"], capsys)
    assert code == 2 and "plugins:" in text and "'plug_mod_exit'" in text, text


def test_file_data_without_a_model_folder_is_refused(no_programs, capsys):
    (no_programs / "train.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    code, text = _train(["--data.source", "jsonl", "--data.path", "train.jsonl",
                         "--model.path", ""], capsys)
    assert code == 2 and "model.path: required with data.source='jsonl'" in text, text


def test_reward_registered_in_the_config_file_is_refused(no_programs, capsys):
    (no_programs / "cfg.py").write_text(textwrap.dedent("""
        from rlflow.config import ExperimentConfig, RewardConfig
        from rlflow.data.rewards import register_reward

        @register_reward("only_in_config_file")
        def f(completion, answer):
            return 1.0

        def config():
            return ExperimentConfig(reward=RewardConfig(functions=("only_in_config_file",)))
    """))
    code, text = _train(["--config", "cfg.py"], capsys)
    assert code == 2 and "reward.functions: 'only_in_config_file' is registered in" in text
    assert "plugins" in text and "package.module:function" in text


@pytest.mark.parametrize("signature, ok", [
    ("completion", False), ("*, completion, answer", False), ("a, b, c", False),
    ("completion, answer", True), ("completion, answer, bonus=0.0", True), ("*args", True),
    ("completion, *rest, **kw", True), ("completion, answer, *, finish_reason", True),
    ("completion, answer, finish_reason='stop'", True), ("completion, *, finish_reason", False)])
def test_a_reward_function_that_cannot_take_completion_and_answer_is_refused(
        no_programs, capsys, signature, ok):
    (no_programs / "sig_rewards.py").write_text(f"def f({signature}):\n    return 1.0\n")
    args = ["--reward.functions", "sig_rewards.py:f", "--reward.weights", "1.0"]
    if ok:                              # every check passed: the programs would start
        with pytest.raises(AssertionError, match="rlflow train started the programs"):
            _train(args, capsys)
        return
    code, text = _train(args, capsys)
    assert code == 2 and ("reward.functions: 'sig_rewards.py:f' cannot be called as "
                          "fn(completion, answer)") in text and f"({signature})" in text, text


USER_MODULE = textwrap.dedent("""
    from rlflow.data.rewards import register_reward

    @register_reward("user_shout")
    def shout(completion, answer):
        return float(completion.isupper())

    def length(completion, answer):
        return float(len(completion))
""")

PROGRAM = textwrap.dedent("""
    import sys
    from rlflow.control import programs_common as pc
    from rlflow.data.rewarder import Rewarder
    cfg = pc.load_config(sys.argv[1])            # what a sampler child does
    with Rewarder(cfg.reward, plugins=cfg.plugins) as r:
        print(r.score_group(0, ["AB", "abc"], "x").tolist())
""")


def test_user_reward_module_reaches_a_program_that_rebuilds_the_config_from_json(tmp_path):
    """A module in the user's folder, listed in ``plugins`` (registered name) and named
    ``module:function``: check_runnable accepts it, and a fresh interpreter that only reads
    the resolved config.json (as the sampler does) scores with both, in its workers."""
    (tmp_path / "user_rewards.py").write_text(USER_MODULE)
    cfg = ExperimentConfig(plugins=("user_rewards",), reward=RewardConfig(
        functions=("user_shout", "user_rewards:length"), weights=(10.0, 1.0)))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        check_runnable(cfg)
    finally:
        os.chdir(cwd)
    pc.save_config(cfg, str(tmp_path / "config.json"))
    assert json.load(open(tmp_path / "config.json"))["plugins"] == ["user_rewards"]
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", PROGRAM, "config.json"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[12.0, 3.0]"   # 10*1 + 2, 10*0 + 3


def test_check_runnable_accepts_the_shipped_demo_config():
    check_runnable(ExperimentConfig())
    with pytest.raises(ConfigError, match=r"^reward.functions: unknown reward function"):
        check_runnable(ExperimentConfig(reward=RewardConfig(functions=("x",))))


def test_group_relative_advantages_need_two_samples_per_group_gae_does_not():
    from rlflow.config import LearnerConfig, SamplerConfig

    for adv in ("grpo", "drgrpo", "rloo"):
        with pytest.raises(ConfigError, match=rf"^sampler.group_size: must be >= 2 with "
                                              rf"learner.advantage='{adv}'"):
            ExperimentConfig(sampler=SamplerConfig(group_size=1),
                             learner=LearnerConfig(advantage=adv, groups_per_step=2))
    cfg = ExperimentConfig(sampler=SamplerConfig(group_size=1),
                           learner=LearnerConfig(advantage="gae", groups_per_step=2))
    assert cfg.sampler.group_size == 1


@pytest.mark.parametrize("field, value", [("num_workers", -1), ("memory_limit_mb", -5)])
def test_reward_worker_fields_are_checked(field, value):
    with pytest.raises(ConfigError, match=rf"^reward.{field}: must be >= 0"):
        RewardConfig(**{field: value})


def test_layouts_a_one_device_sampler_can_take_from_a_two_device_learner():
    """Refused above: 'native' from a 2-device learner to a 1-device sampler (its first pull
    would fail after start-up). Runnable: the single_device layout, the orbax fallback, a
    sampler with as many devices, a 2-host learner (per-host shards)."""
    from rlflow.config import LearnerConfig, MeshConfig, RuntimeConfig, SamplerConfig, replace

    two = LearnerConfig(num_devices=2, mesh=MeshConfig(fsdp=2))
    with pytest.raises(ConfigError, match=r"^runtime\.transfer_layout: 'native'"):
        check_runnable(ExperimentConfig(learner=two))
    for cfg in (ExperimentConfig(learner=two, runtime=RuntimeConfig(transfer_layout="single_device")),
                ExperimentConfig(learner=two, runtime=RuntimeConfig(weight_transfer="orbax")),
                ExperimentConfig(learner=two, sampler=SamplerConfig(num_devices=2,
                                                                    mesh=MeshConfig(tensor=2))),
                ExperimentConfig(learner=replace(two, num_hosts=2))):
        check_runnable(cfg)


def test_a_lora_rank_above_a_projections_smaller_side_is_a_warning(monkeypatch, tmp_path, capsys):
    """rank 48 on the demo model: k_proj (hidden -> kv heads x head_dim = 32) and down_proj
    are named, q_proj (64 -> 64) is not; the run still starts (exit code of run_train)."""
    import rlflow.launcher.supervisor

    monkeypatch.setattr(rlflow.launcher.supervisor, "run_train", lambda cfg: 0)
    monkeypatch.chdir(tmp_path)
    m = ExperimentConfig().model
    kv = m.num_kv_heads * m.head_dim
    assert kv < 48 <= m.hidden_size          # the sizes this test's expectations rest on
    code = cli.main(["train", "--run-dir", "runs", "--learner.lora.rank", "48",
                     "--learner.lora.targets", "q_proj", "k_proj", "down_proj"])
    err = capsys.readouterr().err
    assert code == 0
    warned = [x for x in err.splitlines() if x.startswith("rlflow train: warning:")]
    assert len(warned) == 1
    assert f"k_proj [{m.hidden_size} -> {kv}]" in warned[0]
    assert "q_proj" not in warned[0]
    assert ("down_proj" in warned[0]) == (48 > min(m.intermediate_size, m.hidden_size))
    code = cli.main(["train", "--run-dir", "runs", "--learner.lora.rank", str(kv),
                     "--learner.lora.targets", "k_proj"])
    assert code == 0 and "warning" not in capsys.readouterr().err


def test_lora_rank_warning_reads_a_model_folders_config(tmp_path):
    """With model.path the sizes come from its config.json (no weights read)."""
    from rlflow.config import LearnerConfig, LoraConfig, ModelConfig
    from rlflow.console.checks import config_warnings

    spec = ModelConfig(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                       head_dim=16, vocab_size=128)
    hf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
          "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 16, "num_hidden_layers": 1, "vocab_size": 128, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    for path, model in ((str(tmp_path), ModelConfig(path=str(tmp_path))), ("", spec)):
        cfg = ExperimentConfig(model=model, learner=LearnerConfig(
            lora=LoraConfig(rank=20, targets=("v_proj", "up_proj"))))
        (warning,) = config_warnings(cfg)
        assert "v_proj [32 -> 16]" in warning and "up_proj" not in warning, (path, warning)
    assert config_warnings(ExperimentConfig(model=spec)) == []          # LoRA off


def test_greedy_sampling_with_group_relative_advantages_is_a_warning(monkeypatch, tmp_path,
                                                                      capsys):
    """temperature 0, group of 8, GRPO: one warning, the run starts; with a temperature, or a
    truncating sampler over a longer data limit, none."""
    import rlflow.launcher.supervisor

    monkeypatch.setattr(rlflow.launcher.supervisor, "run_train", lambda cfg: 0)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--run-dir", "runs", "--sampler.temperature", "0"]) == 0
    warned = [x for x in capsys.readouterr().err.splitlines() if "warning:" in x]
    assert warned == ["rlflow train: warning: sampler.temperature 0 (greedy) gives the 8 samples "
                      "of a group the same completion, so learner.advantage='grpo' (reward minus "
                      "the group's mean) is 0 for every sample and nothing is learned; sample "
                      "with a temperature > 0"]
    assert cli.main(["train", "--run-dir", "runs", "--sampler.temperature", "0.7",
                     "--data.max-prompt-tokens", "100", "--sampler.on-long-prompt",
                     "truncate"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_kv_cache_bytes_are_those_the_engine_allocates(dtype):
    from rlflow.config import SamplerConfig, replace
    from rlflow.sampler.memory import kv_cache_bytes
    from rlflow.models.config import DecoderConfig
    from rlflow.models.kv_cache import init_cache

    cfg = replace(ExperimentConfig(), sampler=SamplerConfig(
        num_slots=4, max_prefill_length=8, prefill_buckets=(8,), max_tokens=24, dtype=dtype))
    m = DecoderConfig.from_model_config(cfg.model)
    cache = init_cache(DecoderConfig.from_model_config(
        cfg.model if dtype is None else replace(cfg.model, dtype=dtype)), 4, 8 + 24)
    assert kv_cache_bytes(cfg, m) == sum(x.nbytes for x in (*cache.k, *cache.v))


def test_paged_kv_cache_bytes_are_those_the_engine_allocates():
    """sampler.kv_cache="paged": the pool's pages (issue 43 item 5), not slots x length."""
    import jax

    from rlflow.config import SamplerConfig, replace
    from rlflow.sampler.memory import kv_cache_bytes
    from rlflow.models.config import DecoderConfig
    from rlflow.models.paged_kv_cache import init_paged_cache

    sp = SamplerConfig(num_slots=16, max_prefill_length=8, prefill_buckets=(8,), max_tokens=24,
                       kv_cache="paged", page_size=4, num_pages=10)
    cfg = replace(ExperimentConfig(), sampler=sp)
    m = DecoderConfig.from_model_config(cfg.model)
    cache = jax.eval_shape(lambda: init_paged_cache(m, 16, 10, 4, sp.pages_per_slot))
    got = sum(x.size * x.dtype.itemsize for x in (*cache.k, *cache.v))
    assert kv_cache_bytes(cfg, m) == got
    contiguous = kv_cache_bytes(replace(cfg, sampler=replace(sp, kv_cache="contiguous")), m)
    assert contiguous * (10 * 4) == got * (16 * (8 + 24))    # positions: pages x P vs slots x S


def test_a_reasoning_parser_that_cannot_load_is_refused(no_programs, capsys):
    """Issue 44.5: data.reasoning_parser 'module:function' is checked before programs start."""
    (no_programs / "think.py").write_text("def split(text):\n    return ('', text)\n")
    code, text = _train(["--data.reasoning-parser", "think.py:nope"], capsys)
    assert code == 2 and "data.reasoning_parser" in text and "nope" in text, text
    with pytest.raises(AssertionError, match="rlflow train started the programs"):
        _train(["--data.reasoning-parser", "think.py:split"], capsys)


def test_lora_on_a_moe_models_mlp_is_refused_naming_the_targets(no_programs, capsys):
    """Qwen3-MoE: LoRA adapts the attention projections only (the experts are not adapted);
    the default targets (all seven projections) are refused at start, naming the field."""
    code, out = _train(["--model.path", "", "--model.model-type", "qwen3_moe",
                        "--learner.lora.rank", "4"], capsys)
    assert code == 2
    assert "learner.lora.targets" in out and "gate_proj" in out and "qwen3_moe" in out
    assert not os.path.exists(no_programs / "runs")


@pytest.mark.parametrize("args, field, where", [
    (["--model.path", "", "--model.num-experts", "4"], "model.num_experts", "'llama' (dense)"),
    (["--model.path", "", "--model.model-type", "qwen3", "--model.norm-topk-prob", "false"],
     "model.norm_topk_prob", "'qwen3' (dense)"),
    (["--model.num-experts-per-tok", "3"], "model.num_experts_per_tok", "'llama' (dense)"),
    (["--learner.moe-aux-loss-coef", "0.1"], "learner.moe_aux_loss_coef", "(config.json)"),
    (["--model.path", "", "--learner.moe-aux-loss-coef", "0"], "learner.moe_aux_loss_coef",
     "model_type 'llama', model.model_type"),
])
def test_moe_settings_on_a_dense_model_are_refused_naming_the_field(no_programs, capsys, args,
                                                                     field, where):
    """A mixture-of-experts field on a dense model (the random one, or the demo's model.path
    folder) would be silently ignored: refused at start, naming the field and the model."""
    code, out = _train(args, capsys)
    assert code == 2
    assert f"{field}:" in out and where in out, out
    assert not os.path.exists(no_programs / "runs")


def test_moe_settings_on_a_moe_model_pass_the_checks(no_programs, capsys):
    with pytest.raises(AssertionError, match="started the programs"):
        _train(["--model.path", "", "--model.model-type", "qwen3_moe", "--model.num-experts", "4",
                "--model.norm-topk-prob", "false", "--learner.moe-aux-loss-coef", "0.1"], capsys)
