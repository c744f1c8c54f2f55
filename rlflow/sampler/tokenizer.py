"""Hugging Face tokenizers behind JetStream's ``Tokenizer`` API, and the model's stop ids.

A model's end-of-sequence ids are the union of ``generation_config.json``'s
``eos_token_id`` (often a list, e.g. Qwen2.5-Instruct's ``[151645, 151643]``),
``config.json``'s and the tokenizer's own ``eos_token_id``: stopping only on the
tokenizer's id would run chat models past their end-of-turn token.
"""

from __future__ import annotations

import os
from typing import Iterable

import numpy as np
from rlflow.sampler.jetstream_api import tokenizer_api


def model_eos_token_ids(path: str, tokenizer=None) -> tuple[int, ...]:
    """Every EOS id of the HF folder ``path``, sorted.

    Those of ``generation_config.json`` and ``config.json`` (when present; read with
    ``rlflow.models.hf``'s readers), plus ``tokenizer.eos_token_id`` when a tokenizer is given.

    Raises:
      FileNotFoundError: ``path`` is not a folder.
      rlflow.models.config.ModelFormatError: config.json is present but not JSON.
    """
    from rlflow.models.config import eos_token_ids
    from rlflow.models.hf import CONFIG_FILE, generation_eos_ids, read_hf_config

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model folder not found: {path}")
    ids = set(generation_eos_ids(path))
    if os.path.isfile(os.path.join(path, CONFIG_FILE)):
        ids.update(eos_token_ids(read_hf_config(path).get("eos_token_id")))
    if tokenizer is not None:
        ids.update(eos_token_ids(tokenizer.eos_token_id))
    return tuple(sorted(ids))


class HFTokenizer(tokenizer_api.Tokenizer):
    """JetStream ``Tokenizer`` over the folder's ``transformers`` tokenizer
    (:func:`rlflow.data.tokenizer.load_tokenizer`).

    Args:
      path: local HF folder with tokenizer files (and optionally generation_config.json).
      stop_ids: extra stop ids; the model's EOS ids (:func:`model_eos_token_ids`) are
        always included.
    """

    def __init__(self, path: str, stop_ids: Iterable[int] = ()):
        from rlflow.data.tokenizer import load_tokenizer

        self.path = path
        self.hf = load_tokenizer(path)      # as every program and the pre-start check build it
        self._stop = set(model_eos_token_ids(path, self.hf)) | {int(i) for i in stop_ids}

    def encode(self, s: str, **kwargs) -> tuple[np.ndarray, int]:
        """Token ids of ``s`` (int32 ``[n]``, no padding) and their count ``n``."""
        ids = np.asarray(self.hf.encode(s, add_special_tokens=kwargs.get("add_special_tokens",
                                                                          True)), np.int32)
        return ids, int(ids.size)

    def decode(self, token_ids: list[int], **kwargs) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=kwargs.get(
            "skip_special_tokens", False))

    @property
    def pad_id(self) -> int:
        pad = self.hf.pad_token_id
        return int(pad) if pad is not None else self.eos_id

    @property
    def eos_id(self) -> int:
        eos = self.hf.eos_token_id
        return int(eos) if eos is not None else min(self._stop, default=0)

    @property
    def bos_id(self) -> int:
        bos = self.hf.bos_token_id
        return int(bos) if bos is not None else -1

    @property
    def stop_tokens(self) -> set[int]:
        """Every id that ends a completion (all EOS ids of the model)."""
        return set(self._stop)
