"""Config dataclasses: bad values fail at construction with the field named; config files."""

import textwrap

import pytest

from rlflow.config import (BufferConfig, CheckpointConfig, ConfigError, DataConfig,
                           ExperimentConfig, LearnerConfig, MeshConfig, MetricsConfig,
                           ModelConfig, RewardConfig, RuntimeConfig, SamplerConfig,
                           load_config_file, replace)

BAD = [
    (ModelConfig, dict(model_type="gpt2"), "model.model_type"),
    (ModelConfig, dict(num_heads=4, num_kv_heads=3), "model.num_kv_heads"),
    (ModelConfig, dict(hidden_size=0), "model.hidden_size"),
    (ModelConfig, dict(dtype="float16"), "model.dtype"),
    (ModelConfig, dict(path="/definitely/not/here"), "model.path"),
    (MeshConfig, dict(tensor=0), "mesh.tensor"),
    (DataConfig, dict(source="jsonl"), "data.path"),
    (DataConfig, dict(plain_template="no placeholder"), "data.plain_template"),
    (RewardConfig, dict(functions=("a", "b"), weights=(1.0,)), "reward.weights"),
    (SamplerConfig, dict(prefill_buckets=(32, 16), max_prefill_length=32), "sampler.prefill_buckets"),
    (SamplerConfig, dict(top_p=0.0), "sampler.top_p"),
    (SamplerConfig, dict(num_devices=2), "sampler.mesh"),
    (LearnerConfig, dict(lr=-1.0), "learner.lr"),
    (LearnerConfig, dict(clip_low=1.0), "learner.clip_low"),
    (LearnerConfig, dict(dual_clip=0.5), "learner.dual_clip"),
    (BufferConfig, dict(bind_address="0.0.0.0"), "buffer.token"),
    (BufferConfig, dict(port=70000), "buffer.port"),
    (RuntimeConfig, dict(mode="sync", max_staleness=2), "runtime.max_staleness"),
    (CheckpointConfig, dict(keep_last=0), "checkpoint.keep_last"),
    (MetricsConfig, dict(progress="fancy"), "metrics.progress"),
    (ExperimentConfig, dict(name="a/b"), "name"),
    # an infinite timeout would let one hung call, peer or replica stall the run silently
    (RuntimeConfig, dict(replica_timeout_s=float("inf")), "runtime.replica_timeout_s"),
    (RuntimeConfig, dict(transfer_timeout_s=float("inf")), "runtime.transfer_timeout_s"),
    (BufferConfig, dict(timeout_s=float("inf")), "buffer.timeout_s"),
    (RewardConfig, dict(timeout_s=float("inf")), "reward.timeout_s"),
    (RewardConfig, dict(timeout_s=float("nan")), "reward.timeout_s"),
]


@pytest.mark.parametrize("cls,kwargs,field", BAD, ids=[f"{c.__name__}-{f}" for c, _, f in BAD])
def test_bad_value_names_the_field(cls, kwargs, field):
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        cls(**kwargs)


def test_defaults_are_valid_and_frozen():
    cfg = ExperimentConfig()
    with pytest.raises(AttributeError):
        cfg.name = "x"
    assert cfg.run_path.endswith("demo")


def test_replace_revalidates():
    cfg = LearnerConfig()
    assert replace(cfg, lr=1e-5).lr == 1e-5
    with pytest.raises(ConfigError, match="learner.lr"):
        replace(cfg, lr=0.0)


def test_one_of_error_lists_allowed_values():
    with pytest.raises(ConfigError, match=r"learner.advantage: must be one of "
                                          r"\['drgrpo', 'gae', 'grpo', 'rloo'\], got 'ppo'"):
        LearnerConfig(advantage="ppo")


def _write(tmp_path, body):
    path = tmp_path / "cfg.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_load_config_file(tmp_path):
    path = _write(tmp_path, """
        from rlflow.config import ExperimentConfig
        def config():
            return ExperimentConfig(name="from_file", seed=7)
    """)
    cfg = load_config_file(path)
    assert cfg.name == "from_file" and cfg.seed == 7


def test_load_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config_file(str(tmp_path / "missing.py"))
    with pytest.raises(ConfigError, match="is a folder; --config takes a Python file"):
        load_config_file(str(tmp_path))
    (tmp_path / "notes.md").write_text("# not a config\n")
    with pytest.raises(ConfigError, match=r"notes\.md: not a Python file"):
        load_config_file(str(tmp_path / "notes.md"))
    no_fn = _write(tmp_path, "x = 1\n")
    with pytest.raises(ConfigError, match="must define a function `config"):
        load_config_file(no_fn)
    wrong = _write(tmp_path, "def config():\n    return {'name': 'x'}\n")
    with pytest.raises(ConfigError, match="config\\(\\) must return ExperimentConfig, got dict"):
        load_config_file(wrong)
    bad_value = _write(tmp_path, """
        from rlflow.config import ExperimentConfig, LearnerConfig
        def config():
            return ExperimentConfig(learner=LearnerConfig(lr=-1.0))
    """)
    with pytest.raises(ConfigError, match="learner.lr"):
        load_config_file(bad_value)


def test_model_folder_without_config_json_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"model\.path: .*has no config\.json"):
        ModelConfig(path=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert ModelConfig(path=str(tmp_path)).path == str(tmp_path)


def test_buffer_and_coordinator_on_one_port_are_refused_up_front():
    """Both servers bound on one port would start the run and then fail in the learner
    ("Address already in use"); refused at construction instead, naming both fields."""
    with pytest.raises(ConfigError, match=r"^runtime\.coordinator_port: must differ from "
                       r"buffer\.port=23456"):
        ExperimentConfig(buffer=BufferConfig(port=23456),
                         runtime=RuntimeConfig(coordinator_port=23456))
    ExperimentConfig(buffer=BufferConfig(port=23456), runtime=RuntimeConfig(coordinator_port=23457))
    ExperimentConfig(buffer=BufferConfig(port=0), runtime=RuntimeConfig(coordinator_port=0))
    # localhost is 127.0.0.1 here, and a wildcard address covers every address
    for buffer_host, coordinator_host in (("localhost", "127.0.0.1"), ("127.0.0.1", "localhost"),
                                          ("0.0.0.0", "127.0.0.1")):
        with pytest.raises(ConfigError, match=r"^runtime\.coordinator_port: must differ"):
            ExperimentConfig(buffer=BufferConfig(port=23456, bind_address=buffer_host,
                                                 token="t" * 32),
                             runtime=RuntimeConfig(coordinator_port=23456,
                                                   bind_address=coordinator_host))
    # one port on two different addresses binds fine
    ExperimentConfig(buffer=BufferConfig(port=23456, bind_address="127.0.0.2"),
                     runtime=RuntimeConfig(coordinator_port=23456))


def _config_sections():
    """Every config dataclass reachable from ExperimentConfig, with its section prefix."""
    import dataclasses

    from rlflow.config import ExperimentConfig

    out, todo = {}, [(ExperimentConfig, "config")]
    while todo:
        cls, section = todo.pop()
        out[cls] = section
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
                else f.default
            if dataclasses.is_dataclass(default) and type(default) not in out:
                todo.append((type(default), f.name if section == "config"
                             else f"{section}.{f.name}"))
    return out


def _float_field_cases():
    from rlflow.config.validation import float_fields

    return [(cls, section, name) for cls, section in _config_sections().items()
            for name in float_fields(cls)]


def test_float_fields_are_found_in_every_section():
    names = {f"{section}.{name}" for _, section, name in _float_field_cases()}
    assert {"learner.lr", "learner.lora.alpha", "reward.weights", "sampler.temperature",
            "model.rope_theta", "env.step_timeout_s", "runtime.replica_timeout_s"} <= names


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("cls, section, name", _float_field_cases(),
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_every_float_field_refuses_non_finite_values_naming_the_field(cls, section, name, bad):
    """Issue 39.8: inf / nan in any float field (a tuple's elements too) is a ConfigError
    naming the field, unless the section lists it in FLOATS_MAY_BE_INF (none does)."""
    import dataclasses
    import math

    default = getattr(cls(), name)
    value = (bad,) * max(1, len(default)) if isinstance(default, tuple) else bad
    if name in getattr(cls, "FLOATS_MAY_BE_INF", ()) and not math.isnan(bad):
        dataclasses.replace(cls(), **{name: value})
        return
    with pytest.raises(ConfigError, match=rf"^{section}\.{name}: must be a finite number"):
        dataclasses.replace(cls(), **{name: value})
