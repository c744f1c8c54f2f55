"""A bad value in a Hugging Face config.json is refused naming the file, the field and what
was expected, whichever check finds it (the reader's own, or DecoderConfig's)."""

import pytest

from rlflow.models import ModelFormatError
from rlflow.models.config import DecoderConfig

WHERE = "/models/x/config.json"


def _config(model_type="qwen3_moe", **over):
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8) \
        if model_type == "qwen3_moe" else {}
    d = DecoderConfig(model_type=model_type, qk_norm=model_type.startswith("qwen3"),
                      **moe).to_hf_dict()
    d.update(over)
    return d


@pytest.mark.parametrize("model_type,over,field,expected", [
    ("qwen3_moe", {"num_experts_per_tok": 8}, "num_experts_per_tok", r"\[1, num_experts=4\]"),
    ("qwen3_moe", {"num_experts": 0, "num_local_experts": 0}, "num_experts", "> 0"),
    ("qwen3_moe", {"moe_intermediate_size": 0}, "moe_intermediate_size", "positive"),
    ("qwen3_moe", {"router_aux_loss_coef": -1.0}, "router_aux_loss_coef", ">= 0"),
    ("llama", {"num_key_value_heads": 3}, "num_kv_heads", "must divide num_heads=4"),
    ("qwen3", {"head_dim": 7}, "head_dim", "even"),
    ("llama", {"rms_norm_eps": 0.0}, "rms_norm_eps", "> 0"),
])
def test_value_checks_name_the_file_and_field(model_type, over, field, expected):
    with pytest.raises(ModelFormatError, match=rf"^{WHERE}: {field}: .*{expected}"):
        DecoderConfig.from_hf_dict(_config(model_type, **over), where=WHERE)


def test_a_value_of_the_wrong_type_names_the_file():
    with pytest.raises(ModelFormatError, match=rf"^{WHERE}: .*wrong type.*'many'"):
        DecoderConfig.from_hf_dict(_config("llama", vocab_size="many"), where=WHERE)


def test_reader_errors_name_the_file_once():
    d = _config("llama")
    del d["num_hidden_layers"]
    with pytest.raises(ModelFormatError) as err:
        DecoderConfig.from_hf_dict(d, where=WHERE)
    assert str(err.value) == f"{WHERE}: num_hidden_layers: required field is missing"


def test_disagreeing_expert_counts_are_refused_naming_both():
    """transformers 4.x names the expert count num_experts, 5.x num_local_experts: a file
    holding both with different values has no one expert count."""
    d = _config(num_experts=4, num_local_experts=8)
    with pytest.raises(ModelFormatError,
                       match=rf"^{WHERE}: num_local_experts: disagrees with num_experts=4.*8"):
        DecoderConfig.from_hf_dict(d, where=WHERE)
    assert DecoderConfig.from_hf_dict(_config(num_experts=4, num_local_experts=4)).num_experts == 4
