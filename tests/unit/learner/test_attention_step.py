"""The train step with memory-efficient attention and chunked logprobs (issue 43 items 2-3):
loss, gradients, logprobs and KL of a packed, shared-prompt batch with logits at loss
positions only equal today's path (materialised "xla" attention, one-pass logprobs); and the
learner with them on data x tensor fake devices equal to today's single-device learner."""

import jax
import numpy as np
import pytest

from rlflow.config import MeshConfig, ModelConfig, RolloutCorrectionConfig
from rlflow.learner.batch import BatchSpec, TrainBatch, build_batch
from rlflow.learner.packing import PackSpec, pack_batch
from rlflow.learner.step import StepSettings, make_grad_fn, policy_logprobs
from rlflow.learner.trainer import Learner
from rlflow.models import attention as A
from learner_fixtures import (assert_same_packed_step, assert_same_train_step,
                              make_group_records, model_and_reference, one_device_mesh,
                              tiny_experiment)

VOCAB, G, T = 64, 4, 6
MODEL = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)
SPEC = BatchSpec(group_size=G, num_rows=8, seq_buckets=(16,), max_tokens=T)


def records(seed):
    return make_group_records(seed, 2, vocab=VOCAB, group_size=G, max_tokens=T, noise=1.0)


@pytest.fixture(scope="module")
def tiny_model():
    return model_and_reference(MODEL)


def test_blockwise_attention_and_chunked_logprobs_step_equals_todays(tiny_model, monkeypatch):
    """Packed with shared prompts, 2 micro-batches, KL reference, logits at loss positions
    only (the learner's default; test_packing.py shows them equal to every position): blockwise attention (blocks of 4 over 16-token
    rows: several blocks, partial ones) + logprobs in chunks of 5 positions equal "xla" +
    one pass (loss, gradients, KL, entropy, IS statistics, per-token logprobs)."""
    graphdef, params, ref = tiny_model
    monkeypatch.setattr(A, "BLOCK", 4)       # the default (512) holds a row in one block
    batch, _ = build_batch(records(7), SPEC, 0)
    spec = PackSpec.create(num_rows=8, max_row=16, pack_length=16, buckets=4, split=2,
                           shared_prefix=True)
    packed, _ = pack_batch(batch, spec)
    assert packed.prefix_ids is not None
    jb = TrainBatch(*packed)
    out = {}
    for name, attention, chunk in (("today", "xla", 0), ("new", "blockwise", 5)):
        s = StepSettings(loss_agg="seq-mean-token-mean", norm_len=T, micro_batches=2,
                         kl_coef=0.3, correction=RolloutCorrectionConfig(weight_cap=1.5),
                         max_loss_tokens=SPEC.num_rows * T, attention=attention,
                         logprob_chunk=chunk)
        out[name] = jax.jit(make_grad_fn(graphdef, s))(params, jb, ref) + (np.asarray(
            policy_logprobs(graphdef, params, jb, attention=attention,
                            logprob_chunk=chunk)[0]),)
    assert_same_packed_step(MODEL, packed, out["today"], out["new"])


@pytest.mark.slow
def test_sharded_learner_with_new_attention_equals_single_device_today():
    """The default learner (packed, shared prompts, ``attention="auto"`` -> blockwise on CPU,
    logprobs in chunks of 8) on data=2 x tensor=2 fake devices with 2 micro-batches equals
    the single-device learner on today's path ("xla" attention, one-pass logprobs)."""
    kw = dict(micro_batches=2, kl_coef=0.5, loss_agg="seq-mean-token-mean")
    recs = records(11)
    new = Learner(tiny_experiment(MODEL, G, T, num_devices=4,
                                  mesh=MeshConfig(data=2, tensor=2), logprob_chunk=8, **kw))
    today = Learner(tiny_experiment(MODEL, G, T, attention="xla", logprob_chunk=0, **kw),
                    mesh=one_device_mesh())
    mn, mt = new.train_on(recs), today.train_on(recs)
    assert_same_train_step(mn, mt, new.params, today.params, MODEL,
                           rows=8, seq=16)
