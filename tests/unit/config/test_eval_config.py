"""The eval section: bad values name their field; None fields take the data section's."""

import pytest

from rlflow.config import (ConfigError, DataConfig, EvalConfig, ExperimentConfig, RewardConfig,
                           SamplerConfig)
from rlflow.config.eval import eval_data_config, eval_max_tokens, eval_reward_config


@pytest.mark.parametrize("kwargs,field", [
    (dict(every_steps=-1), "eval.every_steps"),
    (dict(num_samples=0), "eval.num_samples"),
    (dict(num_prompts=-2), "eval.num_prompts"),
    (dict(temperature=-0.1), "eval.temperature"),
    (dict(top_p=0.0), "eval.top_p"),
    (dict(functions=("math_verify",), weights=()), "eval.weights"),
    (dict(source="csv"), "eval.source"),
    (dict(plain_template="no field"), "eval.plain_template"),
    (dict(timeout_s=float("inf")), "eval.timeout_s"),
])
def test_bad_eval_value_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        EvalConfig(**kwargs)


def test_cross_section_checks_name_the_field(tmp_path):
    data = DataConfig(source="jsonl", path=str(tmp_path / "train.jsonl"))
    with pytest.raises(ConfigError, match=r"eval\.max_tokens: must be <= sampler\.max_tokens=16"):
        ExperimentConfig(sampler=SamplerConfig(max_tokens=16), eval=EvalConfig(max_tokens=17))
    with pytest.raises(ConfigError, match=r"eval\.path: is required"):
        ExperimentConfig(data=data, eval=EvalConfig(every_steps=2))
    with pytest.raises(ConfigError, match=r"eval\.path: .* must differ from data\.path"):
        ExperimentConfig(data=data, eval=EvalConfig(every_steps=2, path=data.path))


def test_resolved_sections_take_the_data_and_reward_values(tmp_path):
    cfg = ExperimentConfig(
        data=DataConfig(source="jsonl", path="train.jsonl", chat_template="plain",
                        plain_template="Q: {prompt}", max_prompt_tokens=48, shuffle_seed=3),
        reward=RewardConfig(functions=("math_verify", "math_format"), weights=(1.0, 0.1)),
        eval=EvalConfig(every_steps=1, path="test.jsonl", max_prompt_tokens=60))
    data = eval_data_config(cfg)
    assert (data.source, data.path, data.chat_template, data.plain_template,
            data.max_prompt_tokens, data.num_epochs) == (
        "jsonl", "test.jsonl", "plain", "Q: {prompt}", 60, 1)
    assert eval_reward_config(cfg) is cfg.reward
    assert eval_max_tokens(cfg) == cfg.sampler.max_tokens
    own = ExperimentConfig(eval=EvalConfig(functions=("exact_match",), weights=(2,),
                                           max_tokens=3))
    assert eval_reward_config(own).functions == ("exact_match",)
    assert eval_reward_config(own).weights == (2.0,)
    assert eval_max_tokens(own) == 3


def test_rlflow_train_checks_the_eval_file_and_functions_before_starting(tmp_path):
    from rlflow.console.checks import check_runnable

    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match=r"eval\.path: no file matches .*nope\.jsonl"):
        check_runnable(ExperimentConfig(eval=EvalConfig(every_steps=1, source="jsonl",
                                                        path=missing)))
    with pytest.raises(ConfigError, match=r"eval\.functions: unknown reward function 'nope'"):
        check_runnable(ExperimentConfig(eval=EvalConfig(every_steps=1, functions=("nope",),
                                                        weights=(1.0,))))
    with pytest.raises(ConfigError, match=r"eval\.max_prompt_tokens: 65 is above "
                                          r"sampler\.max_prefill_length=64"):
        check_runnable(ExperimentConfig(eval=EvalConfig(every_steps=1, max_prompt_tokens=65)))


def _held_out_cfg(train, held_out):
    return ExperimentConfig(data=DataConfig(source="jsonl", path=str(train)),
                            eval=EvalConfig(every_steps=1, path=str(held_out)))


@pytest.mark.parametrize("spelling", ["symlink", "hardlink", "glob", "folder", "dotted"])
def test_eval_path_naming_the_training_file_by_another_spelling_is_refused(tmp_path, spelling):
    """The same training file reached by a symlink, a hard link, a glob that covers it, its
    folder, or a path with ``..``: refused before start, naming both paths."""
    import os

    from rlflow.console.checks import check_runnable

    data = tmp_path / "data"
    data.mkdir()
    train = data / "train.jsonl"
    train.write_text('{"prompt": "1 + 1", "answer": "2"}\n')
    (data / "test.jsonl").write_text('{"prompt": "2 + 2", "answer": "4"}\n')
    if spelling == "symlink":
        held_out = tmp_path / "held_out.jsonl"
        held_out.symlink_to(train)
    elif spelling == "hardlink":
        held_out = tmp_path / "held_out.jsonl"
        os.link(train, held_out)
    elif spelling == "glob":
        held_out = data / "*.jsonl"
    elif spelling == "folder":
        held_out = data
    else:
        held_out = tmp_path / "other" / ".." / "data" / "train.jsonl"
        (tmp_path / "other").mkdir()
    with pytest.raises(ConfigError) as e:
        if spelling == "dotted":        # refused where the config is built (real paths)
            _held_out_cfg(train, held_out)
        else:
            check_runnable(_held_out_cfg(train, held_out))
    msg = str(e.value)
    assert msg.startswith("eval.path: ") and str(train) in msg and str(held_out) in msg, msg
    assert "training prompts" in msg


def test_a_training_glob_covering_the_eval_file_is_refused(tmp_path):
    from rlflow.console.checks import check_runnable

    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text('{"prompt": "1 + 1", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=r"eval\.path: .*b\.jsonl"):
        check_runnable(_held_out_cfg(tmp_path / "*.jsonl", tmp_path / "b.jsonl"))


def test_a_different_eval_file_with_the_same_contents_is_accepted(tmp_path):
    """Identity, not contents: a copy is another file (it may be a real held-out split)."""
    from rlflow.console.file_checks import check_held_out

    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    for p in (train, test):
        p.write_text('{"prompt": "1 + 1", "answer": "2"}\n')
    check_held_out(_held_out_cfg(train, test))
    check_held_out(_held_out_cfg(tmp_path / "train*.jsonl", tmp_path / "t*t.jsonl"))
