"""MFU and throughput accounting (rlflow/run/perf.py, issue 42 item 4): a learner step's
``perf/mfu`` against a FLOP count written out by hand from the test model's architecture."""

import numpy as np
import pytest

from rlflow.config import ModelConfig
from rlflow.learner.trainer import Learner
from rlflow.run import perf
from learner_fixtures import make_group_records, one_device_mesh, tiny_experiment

VOCAB, G, T = 64, 4, 6
# E = 32, F = 64, L = 2, H = 4 query heads, K = 2 kv heads, D = 8
MODEL = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)


def hand_count_train_flops(records) -> float:
    """PaLM appendix B by hand: 6 N + 12 L H D T per token, T the sample's length."""
    per_layer = (32 * 4 * 8          # q projection E x H D
                 + 2 * 32 * 2 * 8    # k, v projections E x K D
                 + 4 * 8 * 32        # o projection H D x E
                 + 3 * 32 * 64)      # SwiGLU gate, up, down E x F
    n_params = 2 * per_layer + 32 * VOCAB   # 2 layers + the (tied) LM head E x V
    assert n_params == 2 * 9216 + 2048
    total = 0.0
    for r in records:
        for c in r["completion_lengths"]:
            t = len(r["prompt_tokens"]) + int(c)       # tokens of prompt + completion
            total += t * (6 * n_params + 12 * 2 * 4 * 8 * t)
    return total


@pytest.fixture(scope="module")
def learner():
    return Learner(tiny_experiment(MODEL, G, T, packing=False), mesh=one_device_mesh())


def test_learner_step_mfu_equals_hand_count(learner):
    records = make_group_records(0, 2, vocab=VOCAB, group_size=G, max_tokens=T)
    m = learner.train_on(records)
    flops = hand_count_train_flops(records)
    tokens = sum(len(r["prompt_tokens"]) * G + int(r["completion_lengths"].sum())
                 for r in records)
    assert m["batch/tokens"] == tokens
    np.testing.assert_allclose(m["batch/model_flops"], flops, rtol=1e-12)
    # one CPU device: the peak is the process's measured jnp.dot (cached, the learner's)
    peak = perf.measured_cpu_peak("float32")
    compute_s = m["learner/step_time_s"] - m["learner/compile_s"]     # compile left out
    assert m["learner/compile_s"] > 0                  # the first step compiled its shape
    want = flops / compute_s / peak
    np.testing.assert_allclose(m["perf/mfu"], want, rtol=0.01)
    np.testing.assert_allclose(m["perf/tokens_per_s_per_chip"], tokens / compute_s, rtol=0.01)
    assert 0 < m["perf/mfu"] < 1


def test_packed_batch_counts_the_same_flops(learner):
    """Packing several samples into a row changes the layout, not the model FLOPs: each
    sample still attends its own T tokens."""
    packed = Learner(tiny_experiment(MODEL, G, T, packing=True, shared_prefix=False),
                     mesh=one_device_mesh())
    records = make_group_records(1, 2, vocab=VOCAB, group_size=G, max_tokens=T)
    batch, info = packed.build_batch(records)
    assert batch.segment_ids is not None
    assert len(np.unique(batch.segment_ids[batch.attention_mask])) == len(records) * G
    np.testing.assert_allclose(info["batch/model_flops"], hand_count_train_flops(records),
                               rtol=1e-12)
    assert info["batch/model_flops"] == learner.build_batch(records)[1]["batch/model_flops"]


@pytest.mark.parametrize("kind,peak", [("TPU v4", 275e12), ("TPU v5 lite", 197e12),
                                       ("TPU v5p", 459e12), ("TPU v6 lite", 918e12),
                                       ("NVIDIA H100 80GB HBM3", 989e12),
                                       ("NVIDIA H200", 989e12),
                                       ("NVIDIA A100-SXM4-80GB", 312e12), ("cpu", None)])
def test_peak_table_by_device_kind(kind, peak):
    assert perf.peak_flops_from_table(kind) == peak


def test_measured_cpu_peak_is_cached_and_positive():
    a = perf.measured_cpu_peak("float32")
    assert a > 1e8 and perf.measured_cpu_peak("float32") is a
