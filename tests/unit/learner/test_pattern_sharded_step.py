"""Models of several layer kinds (Gemma 3 text, gpt-oss: rlflow.models.layer_pattern) train
sharded: fsdp=2 x tensor=2 on 4 fake devices gives one device's step (metrics and
parameters after two steps), the sharding rules placing each kind's stack."""

import pytest

from rlflow.config import MeshConfig, ModelConfig
from rlflow.learner.trainer import Learner
from hf_fixtures import PATTERN_FAMILIES, make_tiny_pattern_model
from learner_fixtures import assert_same_train_step, make_group_records, one_device_mesh, \
    tiny_experiment

G, T = 4, 6


@pytest.mark.slow
@pytest.mark.parametrize("family", PATTERN_FAMILIES)
def test_pattern_model_sharded_step_equals_single_device(tmp_path, family):
    path = make_tiny_pattern_model(family, str(tmp_path / family))
    cfg = tiny_experiment(ModelConfig(path=path), G, T, num_devices=4,
                          mesh=MeshConfig(fsdp=2, tensor=2))
    sharded, single = Learner(cfg), Learner(cfg, mesh=one_device_mesh())
    stack = sharded.params["layers"]["sliding_attention"]["attn"]["q_kernel"][...]
    assert len(stack.sharding.device_set) == 4 and not stack.sharding.is_fully_replicated
    for step in range(2):
        recs = make_group_records(step, 2, vocab=64, group_size=G, max_tokens=T)
        m4, m1 = sharded.train_on(recs), single.train_on(recs)
        assert_same_train_step(m4, m1, sharded.params, single.params, single.model_config,
                               rows=G * 2, seq=16)
    assert m1["policy/entropy"] > 0
