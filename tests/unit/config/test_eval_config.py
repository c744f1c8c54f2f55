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
    with pytest.raises(ConfigError, match=r"eval\.path: must differ from data\.path"):
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
