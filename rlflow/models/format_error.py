"""The error of a model folder that does not match what rlflow expects, and the reading of
HF's ``eos_token_id`` field: shared by :mod:`rlflow.models.config` and the family readers
(:mod:`rlflow.models.hf_families`) without an import circle."""

from __future__ import annotations


class ModelFormatError(ValueError):
    """A model folder, config or weight file does not match what rlflow expects.

    The message names the file and the field / tensor, and what was expected.
    """


def eos_token_ids(value) -> tuple[int, ...]:
    """An HF ``eos_token_id`` field (None, one id, or a list of ids) as a tuple of ints."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)
