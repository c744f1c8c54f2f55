"""The distillation teacher on the learner side: a frozen model that scores the student's
sampled tokens (``teacher`` config section, :class:`rlflow.config.TeacherConfig`).

The teacher is loaded from its Hugging Face folder onto the learner's mesh, its parameters
sharded by the same logical-axis rules as the policy's (:func:`rlflow.mesh.param_shardings`).
It is never part of the train state: no optimiser state, no gradient, not published, not
checkpointed. Each training batch (after packing, so shared-prefix packed rows are scored
exactly as the step sees them) goes through one forward-only jitted function::

    teacher logprobs [B, L] = log softmax(teacher(tokens) / T)[targets]

with the batch's positions, segment ids and prefix ids and the sampler's temperature ``T``
(the distribution the student's behaviour logprobs are of). The advantage the step then
trains on is :func:`rlflow.learner.distill.distill_advantages` of those logprobs.

Teacher and student must share the tokenizer: :func:`check_teacher_tokenizer` (run by
``rlflow train`` before anything starts and by the learner at start) compares the two
tokenizers' vocabularies and special tokens (:func:`tokenizer_fingerprint`) and the two
models' vocabulary sizes, naming both folders when they differ.

A teacher on its own devices (its own program, as the sampler is) is a later option; today
it shares the learner's devices and runs between train steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time

import jax
import numpy as np
from flax import nnx

from rlflow.config import ConfigError
from rlflow.learner.batch import TrainBatch, with_sequence_ids
from rlflow.learner.distill import distill_advantages, sampled_reverse_kl
from rlflow.mesh import batch_sharding, param_shardings

logger = logging.getLogger("rlflow.learner")


# ------------------------------------------------------------------------- tokenizer check

def tokenizer_fingerprint(tok) -> str:
    """SHA-256 (hex) of a ``transformers`` tokenizer's vocabulary (token -> id, added tokens
    included) and its special tokens: equal for tokenizers that map every text to the same
    ids, whatever their files' other settings (``model_max_length``, ...)."""
    vocab = sorted(tok.get_vocab().items())
    special = sorted(str(t) for t in tok.all_special_tokens)
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()


def _first_difference(a, b) -> str:
    va, vb = a.get_vocab(), b.get_vocab()
    for token in sorted(set(va) | set(vb)):
        if va.get(token) != vb.get(token):
            return (f"token {token!r} has id {va.get(token)} in the student's, "
                    f"{vb.get(token)} in the teacher's")
    return (f"special tokens {sorted(map(str, a.all_special_tokens))} vs "
            f"{sorted(map(str, b.all_special_tokens))}")


def student_source(cfg) -> str:
    """Where the student's tokenizer comes from, for messages."""
    if cfg.model.path:
        return cfg.model.path
    return f"the built-in task's tokenizer (data.task={cfg.data.task!r})"


def check_teacher_tokenizer(cfg, student_tokenizer=None, student_vocab_size=None) -> None:
    """Teacher and student must share the tokenizer and the model vocabulary size.

    Args:
      cfg: an :class:`rlflow.config.ExperimentConfig` with ``teacher.path`` set.
      student_tokenizer: the run's tokenizer (default:
        :func:`rlflow.control.programs_common.run_tokenizer`).
      student_vocab_size: the student model's vocabulary size (default: its config.json's,
        or ``model.vocab_size`` of a random model).

    Raises:
      ConfigError: naming ``teacher.path``, both folders and the difference: the teacher
        folder has no tokenizer, the tokenizers' fingerprints differ (the first differing
        token), or the models' vocabulary sizes differ.
    """
    from rlflow.data.tokenizer import load_tokenizer
    from rlflow.models.hf import read_decoder_config
    from rlflow.control.programs_common import run_tokenizer

    tpath, spath = cfg.teacher.path, student_source(cfg)
    try:
        teacher_tok = load_tokenizer(tpath)
    except (FileNotFoundError, OSError, ValueError) as e:
        raise ConfigError(f"teacher.path: cannot load the teacher's tokenizer from {tpath!r} "
                          f"({e}); teacher and student must share the tokenizer") from None
    student_tok = student_tokenizer if student_tokenizer is not None else run_tokenizer(cfg)
    fa, fb = tokenizer_fingerprint(student_tok), tokenizer_fingerprint(teacher_tok)
    if fa != fb:
        raise ConfigError(
            f"teacher.path: the teacher's tokenizer ({tpath}: {len(teacher_tok)} tokens, "
            f"fingerprint {fb[:12]}) differs from the student's ({spath}: {len(student_tok)} "
            f"tokens, fingerprint {fa[:12]}): {_first_difference(student_tok, teacher_tok)}; "
            f"on-policy distillation scores the student's token ids with the teacher, so both "
            f"must use the same tokenizer")
    if student_vocab_size is None:
        student_vocab_size = (read_decoder_config(cfg.model.path).vocab_size if cfg.model.path
                              else cfg.model.vocab_size)
    teacher_vocab = read_decoder_config(tpath).vocab_size
    if teacher_vocab != student_vocab_size:
        raise ConfigError(
            f"teacher.path: the teacher's model vocabulary ({tpath}: vocab_size "
            f"{teacher_vocab}) differs from the student's ({spath}: vocab_size "
            f"{student_vocab_size}); the tokenizers match, but both models must have the same "
            f"vocabulary size")


# ------------------------------------------------------------------------------ the teacher

class Teacher:
    """A frozen teacher on the learner's mesh.

    Args:
      cfg: the :class:`rlflow.config.ExperimentConfig` (``teacher``, ``sampler.temperature``,
        ``learner.attention`` / ``logprob_chunk``).
      mesh: the learner's mesh.
      student_vocab_size: the student model's vocabulary size (checked against the teacher's).
      student_tokenizer: the run's tokenizer (default: loaded as the programs load it).

    Raises:
      ConfigError: as :func:`check_teacher_tokenizer`.
      rlflow.models.config.ModelFormatError: the teacher folder cannot be loaded.
    """

    def __init__(self, cfg, mesh, *, student_vocab_size: int, student_tokenizer=None):
        from rlflow.learner.step import policy_logprobs
        from rlflow.models.hf import load_hf

        tc = cfg.teacher
        check_teacher_tokenizer(cfg, student_tokenizer, student_vocab_size)
        self.mode, self.kl_coef, self.baseline = tc.mode, tc.kl_coef, tc.baseline
        t0 = time.perf_counter()
        model, self.model_config = load_hf(tc.path, dtype=tc.dtype, param_dtype=tc.dtype,
                                           mesh=mesh)
        graphdef, self.params = nnx.split(model, nnx.Param)
        del model
        logger.info("teacher %s loaded in %.1f s", tc.path, time.perf_counter() - t0)
        temperature = cfg.sampler.temperature or 1.0
        attention, chunk = cfg.learner.attention, cfg.learner.logprob_chunk

        def forward(params, tokens, attention_mask, positions, targets, segment_ids,
                    prefix_ids):
            batch = TrainBatch(tokens, attention_mask, positions, targets, None, None, None,
                               None, segment_ids, prefix_ids)
            return policy_logprobs(graphdef, params, batch, temperature, attention=attention,
                                   logprob_chunk=chunk)[0]

        bsh = batch_sharding(mesh)
        self._forward = jax.jit(forward, in_shardings=(param_shardings(self.params, mesh),)
                                + (bsh,) * 6, out_shardings=bsh)

    def logprobs(self, batch: TrainBatch) -> np.ndarray:
        """The teacher's tempered logprobs of ``batch.targets``: float32 ``[B, L]`` numpy,
        at every position (those outside ``batch.loss_mask`` are not used).

        Raises: :class:`rlflow.models.decoder.TokenRangeError` for a token id outside the
        teacher's vocabulary.
        """
        from rlflow.models.decoder import validate_tokens

        b = with_sequence_ids(batch)
        validate_tokens(b.tokens, self.model_config.vocab_size, where="teacher batch tokens")
        out = self._forward(self.params, *(np.asarray(x) for x in (
            b.tokens, b.attention_mask, b.positions, b.targets, b.segment_ids, b.prefix_ids)))
        return np.asarray(jax.device_get(out), np.float32)

    def apply(self, batch: TrainBatch, wait=None) -> tuple[TrainBatch, dict]:
        """``batch`` with the distillation advantages (``teacher.mode`` / ``kl_coef``,
        :func:`rlflow.learner.distill.distill_advantages`) in ``advantages``, and its metrics:
        ``distill/reverse_kl`` (mean over the loss positions of ``log pi_behaviour -
        log pi_teacher``, nats per token) and ``distill/teacher_time_s`` (seconds of the
        teacher forward, its compile included the first time a shape is seen).

        ``wait``: device arrays to wait for before the clock starts (the train step in
        flight on the same devices, when the batch is built ahead of it), so the time is
        the teacher's own.
        """
        if wait is not None:
            jax.block_until_ready(wait)
        t0 = time.perf_counter()
        teacher = self.logprobs(batch)
        seconds = time.perf_counter() - t0
        adv = distill_advantages(teacher, batch.behaviour_logprobs, batch.loss_mask,
                                 batch.advantages, mode=self.mode, kl_coef=self.kl_coef,
                                 baseline=self.baseline)
        info = {"distill/reverse_kl": sampled_reverse_kl(teacher, batch.behaviour_logprobs,
                                                         batch.loss_mask),
                "distill/teacher_time_s": seconds}
        return batch._replace(advantages=adv), info
