"""Rollout routing replay in the learner (issue 40 item 3): ``learner.routing_replay``
resolution and errors, and a MoE learner's step replaying the batch's recorded ids, its
``moe/router_agreement`` and ``moe/logprob_gap`` against direct forwards."""


import jax.numpy as jnp
import numpy as np
import pytest

from rlflow.config import ConfigError, ModelConfig
from rlflow.exchange import routing
from rlflow.learner.batch import TrainBatch
from rlflow.learner.routing_replay import replays, routing_shape
from rlflow.learner.step import model_outputs
from rlflow.learner.trainer import Learner
from rlflow.models.config import DecoderConfig
from learner_fixtures import make_group_records, one_device_mesh, tiny_experiment
from tolerances import sum_tol

MOE = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=16)
# the same shapes as a dense Qwen3 (the MoE fields would be refused on a dense model)
DENSE_MODEL = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
DENSE = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)


def test_routing_replay_defaults_on_for_moe_and_refuses_dense_models():
    moe = DecoderConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32,
                        intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, num_experts=200, num_experts_per_tok=2,
                        moe_intermediate_size=16)
    assert replays(None, moe) and not replays(False, moe) and not replays(None, DENSE)
    assert routing_shape(moe) == (2, 2, np.dtype(np.int16)) and routing_shape(DENSE) is None
    with pytest.raises(ConfigError, match="learner.routing_replay: True needs a mixture"):
        replays(True, DENSE)
    with pytest.raises(ConfigError, match="learner.routing_replay: True needs a mixture"):
        tiny_experiment(DENSE_MODEL, 4, 6, routing_replay=True)


@pytest.fixture(scope="module")
def learners():
    def make(replay):
        return Learner(tiny_experiment(MOE, 4, 6, groups_per_step=1, packing=False,
                                       routing_replay=replay), mesh=one_device_mesh())
    return {True: make(None), False: make(False)}


def _routed_batch(learner, seed):
    rec = make_group_records(seed, 1, vocab=64, group_size=4, max_tokens=6)[0]
    rec |= routing.synthetic_routing(np.random.default_rng(seed), rec, num_layers=2, top_k=2,
                                     num_experts=8)
    batch, _ = learner.build_batch([rec])
    return batch


@pytest.mark.parametrize("replay", [True, False])
def test_step_replays_the_recorded_ids_and_logs_agreement_and_gap(learners, replay):
    learner = learners[replay]
    assert learner.settings.routing_replay == replay
    batch = _routed_batch(learner, 0)
    assert batch.routing_ids is not None and batch.routing_ids.dtype == np.int8
    jb = TrainBatch(*(None if x is None else jnp.asarray(x) for x in batch))
    jb = jb._replace(segment_ids=None, prefix_ids=None)
    params = learner.params
    out = model_outputs(learner.graphdef, params, jb, routing_replay=replay)
    logp, agreement = out.logprobs, out.router_agreement
    assert out.values is None and out.aux_loss is None        # no value head, no moe_aux
    other = model_outputs(learner.graphdef, params, jb, routing_replay=not replay).logprobs
    mask = batch.loss_mask
    # random recorded ids differ from the router's own choice: replay changes the logprobs
    assert np.abs(np.asarray(logp) - np.asarray(other))[mask].max() > 1e-4
    metrics = learner.step(batch)
    gap = np.abs(np.asarray(logp, np.float64) - batch.behaviour_logprobs)[mask].mean()
    np.testing.assert_allclose(metrics["moe/logprob_gap"], gap,
                               rtol=sum_tol(int(mask.sum()) + 64 * 2))
    agree = np.asarray(agreement)
    assert 0 < agree[1] and agree[1] == (batch.routing_ids >= 0).all(-1).sum()
    assert metrics["moe/router_agreement"] == pytest.approx(agree[0] / agree[1], abs=1e-6)


def test_dense_learner_logs_no_moe_metrics_and_drops_routing():
    learner = Learner(tiny_experiment(DENSE_MODEL, 4, 6,
                                      groups_per_step=1), mesh=one_device_mesh())
    batch = _routed_batch(learner, 1)
    metrics = learner.step(batch)
    assert not any(k.startswith("moe/") for k in metrics)


def test_multi_host_batch_buffer_carries_the_routing_planes(learners):
    """The int32 buffer host 0 broadcasts to the other learner hosts holds ``layers x k``
    planes of ids after the [B, L] fields; unpacked, the batch is the same."""
    from rlflow.learner.multihost import _FIELDS, _pack, _unpack

    learner = learners[True]
    batch = learner.check_batch(_routed_batch(learner, 3))
    packed = _pack(batch)
    assert packed.shape == (len(_FIELDS) + 4,) + batch.tokens.shape
    back = _unpack(packed, learner.routing)
    assert back.routing_ids.dtype == batch.routing_ids.dtype
    for name in TrainBatch._fields:
        np.testing.assert_array_equal(getattr(back, name), getattr(batch, name), err_msg=name)
