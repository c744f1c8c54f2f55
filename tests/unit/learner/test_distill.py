"""On-policy distillation (issue 44 item 2): the teacher's logprobs of the student's sampled
tokens against a direct ``transformers`` forward of the teacher (padded, packed, shared-prefix
packed, sharded), the distillation advantage against numpy, the tokenizer check, a LoRA
student's steps, and a 2-step ``rlflow train`` with a teacher."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from distill_fixtures import student_teacher_folders
from learner_fixtures import make_group_records
from tolerances import forward_atol, sum_tol

from rlflow.config import (ConfigError, DataConfig, ExperimentConfig, LearnerConfig,
                           LoraConfig, MeshConfig, ModelConfig, SamplerConfig, TeacherConfig,
                           replace)
from rlflow.learner.batch import BatchSpec, build_batch
from rlflow.learner.distill import distill_advantages, sampled_reverse_kl
from rlflow.learner.packing import pack_batch, pack_spec_from_config
from rlflow.learner.teacher import Teacher, check_teacher_tokenizer
from rlflow.mesh import make_mesh
from rlflow.models.hf import read_decoder_config

G, T_MAX, TEMP = 4, 4, 0.7


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``(student, teacher)`` HF folders: random digit-task models with the task's tokenizer."""
    return student_teacher_folders(tmp_path_factory.mktemp("distill"))


def _cfg(student, teacher, *, mode="distill", kl_coef=1.0, devices=1, mesh=None, **learner):
    mesh = mesh or MeshConfig()
    return ExperimentConfig(
        model=ModelConfig(path=student),
        sampler=SamplerConfig(group_size=G, max_tokens=T_MAX, max_prefill_length=8,
                              prefill_buckets=(8,), temperature=TEMP),
        learner=LearnerConfig(groups_per_step=2, seq_buckets=(16,), lr=1e-3,
                              num_devices=devices, mesh=mesh, **learner),
        teacher=TeacherConfig(path=teacher, mode=mode, kl_coef=kl_coef))


def _records(student, seed=0):
    vocab = read_decoder_config(student).vocab_size
    recs = make_group_records(seed, 2, vocab=vocab, group_size=G, max_tokens=T_MAX,
                              noise=1.0)
    mu = np.concatenate([r["behaviour_logprobs"][r["behaviour_logprobs"] != 0]
                         for r in recs])
    assert len(np.unique(mu)) == len(mu)     # behaviour logprobs key the sampled tokens
    return recs


def _reference(teacher, records):
    """``{behaviour logprob: teacher logprob}`` of every sampled token, from a direct
    ``transformers`` forward of each sample alone (prompt + completion, no padding):
    ``log_softmax(logits / T)`` in float64 gathered at the next token; and the bound on
    ``|rlflow - transformers|`` (tolerances.forward_atol at the logits' scale)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    out, scale = {}, 1.0
    for rec in records:
        prompt = np.asarray(rec["prompt_tokens"])
        for s in range(G):
            n = int(rec["completion_lengths"][s])
            ids = np.concatenate([prompt, rec["completion_tokens"][s, :n]])
            with torch.no_grad():
                logits = model(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
            z = logits.astype(np.float64) / TEMP
            scale = max(scale, float(np.abs(z).max()))
            m = z.max(-1, keepdims=True)
            logp = z - (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))
            p = len(prompt)
            for j in range(n):
                out[float(rec["behaviour_logprobs"][s, j])] = logp[p - 1 + j, ids[p + j]]
    cfg = read_decoder_config(teacher)
    return out, forward_atol(cfg, 16, 2 * scale)


def _compare(batch, got, ref, atol):
    mask = batch.loss_mask
    keys = batch.behaviour_logprobs[mask]
    assert len(keys) == len(ref)             # every sampled token scored once
    want = np.array([ref[float(k)] for k in keys])
    np.testing.assert_allclose(got[mask], want, atol=atol, rtol=0)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prefix"])
def test_teacher_logprobs_equal_a_direct_forward_of_the_teacher(folders, layout):
    student, teacher = folders
    cfg = _cfg(student, teacher, packing=layout != "padded",
               shared_prefix=layout == "shared_prefix")
    recs = _records(student)
    batch, _ = build_batch(recs, BatchSpec.from_config(cfg), 0)
    spec = pack_spec_from_config(cfg)
    if spec is not None:
        batch, _ = pack_batch(batch, spec, set())
        assert batch.segment_ids is not None
    mesh = make_mesh(cfg.learner.mesh, jax.devices()[:1])
    got = Teacher(cfg, mesh, student_vocab_size=read_decoder_config(student).vocab_size
                  ).logprobs(batch)
    assert got.shape == batch.tokens.shape and got.dtype == np.float32
    ref, atol = _reference(teacher, recs)
    _compare(batch, got, ref, atol)


def test_sharded_teacher_equals_the_direct_forward(folders):
    """The teacher on 4 fake devices (fsdp 2 x tensor 2), shared-prefix packed batch."""
    student, teacher = folders
    cfg = _cfg(student, teacher, devices=4, mesh=MeshConfig(fsdp=2, tensor=2))
    recs = _records(student, seed=1)
    batch, _ = pack_batch(build_batch(recs, BatchSpec.from_config(cfg), 0)[0],
                          pack_spec_from_config(cfg), set())
    got = Teacher(cfg, make_mesh(cfg.learner.mesh, jax.devices()[:4]),
                  student_vocab_size=read_decoder_config(student).vocab_size).logprobs(batch)
    ref, atol = _reference(teacher, recs)
    _compare(batch, got, ref, atol)


def test_distill_advantages_equal_numpy():
    rng = np.random.default_rng(0)
    shape = (3, 7)
    t_lp, b_lp = rng.normal(-2, 1, shape), rng.normal(-2, 1, shape)
    rl = rng.normal(size=shape)
    mask = rng.random(shape) < 0.6
    t_lp[~mask] = np.nan                  # masked entries never reach the result
    b_lp[0, ~mask[0]] = -np.inf
    b_lp[mask] = np.minimum(b_lp[mask], -0.05)   # logprobs, finite on the loss positions
    pairs = [(i, j) for i in range(shape[0]) for j in range(shape[1]) if mask[i, j]]
    for mode, coef, baseline in (("distill", 1.0, "none"), ("distill", 0.5, "none"),
                                 ("add", 0.25, "none"), ("distill", 1.0, "mean"),
                                 ("add", 0.5, "mean")):
        got = distill_advantages(t_lp, b_lp, mask, rl, mode=mode, kl_coef=coef,
                                 baseline=baseline)
        d = {p: t_lp[p] - b_lp[p] for p in pairs}
        if baseline == "mean":                  # the mean over the loss positions subtracted
            mean = sum(d.values()) / len(d)
            d = {p: v - mean for p, v in d.items()}
        want = np.zeros(shape)
        for p in pairs:
            want[p] = coef * d[p] + (rl[p] if mode == "add" else 0.0)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0,
                                   atol=sum_tol(len(pairs), 8 * np.abs(t_lp[mask]).max()))
    with pytest.raises(ValueError, match="baseline"):
        distill_advantages(t_lp, b_lp, mask, baseline="median")
    kl = np.mean([b_lp[i, j] - t_lp[i, j] for i, j in zip(*np.nonzero(mask))])
    np.testing.assert_allclose(sampled_reverse_kl(t_lp, b_lp, mask), kl,
                               rtol=sum_tol(int(mask.sum()), eps=2.3e-16) + 1e-12)
    assert np.isnan(sampled_reverse_kl(t_lp, b_lp, np.zeros(shape, bool)))
    with pytest.raises(ValueError, match="rl_advantages"):
        distill_advantages(t_lp, b_lp, mask, mode="add")
    with pytest.raises(ValueError, match="mode"):
        distill_advantages(t_lp, b_lp, mask, mode="forward")


def _retokenized(src, dst, alphabet):
    """A copy of the folder ``src`` whose tokenizer is a character tokenizer of ``alphabet``."""
    from rlflow.data.tokenizer import build_char_tokenizer
    from rlflow.models.hf import TOKENIZER_FILES

    shutil.copytree(src, dst)
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(dst, f)):
            os.remove(os.path.join(dst, f))
    build_char_tokenizer(alphabet, dst)
    return dst


def test_a_teacher_with_another_tokenizer_is_refused(folders, tmp_path):
    student, teacher = folders
    swapped = _retokenized(teacher, str(tmp_path / "swapped"), "1023456789>")  # same size
    with pytest.raises(ConfigError) as e:
        check_teacher_tokenizer(_cfg(student, swapped))
    msg = str(e.value)
    assert msg.startswith("teacher.path:") and swapped in msg and student in msg
    assert "'0' has id" in msg or "'1' has id" in msg
    from rlflow.console.checks import check_runnable    # rlflow train's checks refuse it too

    with pytest.raises(ConfigError, match="teacher.path: the teacher's tokenizer"):
        check_runnable(replace(_cfg(student, swapped),
                               data=DataConfig(source="builtin", task="digits",
                                               max_prompt_tokens=8)))
    # same tokenizer, another model vocabulary size
    wide = str(tmp_path / "wide")
    shutil.copytree(teacher, wide)
    with open(os.path.join(wide, "config.json")) as f:
        conf = json.load(f)
    conf["vocab_size"] += 16
    with open(os.path.join(wide, "config.json"), "w") as f:
        json.dump(conf, f)
    with pytest.raises(ConfigError, match="vocab_size") as e:
        check_teacher_tokenizer(_cfg(student, wide))
    assert wide in str(e.value) and student in str(e.value)
    check_teacher_tokenizer(_cfg(student, teacher))      # the shared tokenizer passes


def test_teacher_config_checks(folders):
    student, teacher = folders
    with pytest.raises(ConfigError, match="teacher.kl_coef"):
        TeacherConfig(path=teacher, kl_coef=0.0)
    with pytest.raises(ConfigError, match="teacher.path"):
        TeacherConfig(path=student + "-missing")
    with pytest.raises(ConfigError, match="teacher.baseline"):
        TeacherConfig(path=teacher, baseline="median")
    with pytest.raises(ConfigError, match="learner.dynamic_sampling"):
        _cfg(student, teacher, dynamic_sampling=True)
    with pytest.raises(ConfigError, match="gae"):
        _cfg(student, teacher, advantage="gae", packing=False)


@pytest.mark.parametrize("mode", ["distill", "add"])
def test_lora_student_trains_on_the_distillation_advantage(folders, mode):
    """The learner's batch carries ``kl_coef * (teacher - behaviour)`` (+ the GRPO advantage
    with "add") on the loss positions, with the teacher's logprobs from the direct forward,
    and 0 on an episode's environment token; two steps of a LoRA student ("distill") run and
    log the reverse KL."""
    from rlflow.learner.trainer import Learner

    student, teacher = folders
    cfg = _cfg(student, teacher, mode=mode, kl_coef=0.5, lora=LoraConfig(rank=4))
    learner = Learner(cfg, devices=jax.devices()[:1])
    recs = _records(student, seed=2)
    # a multi-turn episode: its second token came from the environment (never scored)
    s = int(np.argmax(recs[0]["completion_lengths"] >= 2))
    assert recs[0]["completion_lengths"][s] >= 2
    recs[0]["loss_mask"] = np.ones((G, T_MAX), np.int32)
    recs[0]["loss_mask"][s, 1] = 0
    env_key = recs[0]["behaviour_logprobs"][s, 1]
    batch, info = learner.build_batch(recs)
    at_env = batch.behaviour_logprobs == env_key
    assert at_env.sum() == 1 and not batch.loss_mask[at_env].any()
    plain, _ = build_batch(recs, BatchSpec.from_config(cfg), 0)
    ref, atol = _reference(teacher, recs)
    mask = batch.loss_mask
    mu = batch.behaviour_logprobs[mask]
    want = 0.5 * (np.array([ref[float(k)] for k in mu]) - mu)
    if mode == "add":                         # the GRPO advantage of each token's sample
        rl = {float(k): a for k, a in zip(plain.behaviour_logprobs[plain.loss_mask],
                                          plain.advantages[plain.loss_mask])}
        want = want + np.array([rl[float(k)] for k in mu])
    np.testing.assert_allclose(batch.advantages[mask], want, atol=0.5 * atol + 1e-6, rtol=0)
    assert not batch.advantages[~mask].any()
    kl = float(np.mean(mu - np.array([ref[float(k)] for k in mu])))
    np.testing.assert_allclose(info["distill/reverse_kl"], kl, atol=atol)
    assert info["distill/teacher_time_s"] > 0
    for step in (1, 2) if mode == "distill" else ():
        m = learner.train_on(_records(student, seed=2 + step))
        assert np.isfinite(m["distill/reverse_kl"]) and m["learner/tokens"] > 0
        assert learner.version == step
