"""Pre-start checks that look at files on disk by identity or by header: the held-out set is
not a training file (:func:`check_held_out`) and a model folder's weight files are whole
(:func:`check_model_weights`). Both are run by :func:`rlflow.console.checks.check_runnable`.
"""

from __future__ import annotations

import os

from rlflow.config import ConfigError


def check_held_out(cfg, *, offline: bool = False) -> None:
    """``eval.path`` reaches no file that ``data.path`` reaches, whatever the spelling
    (symlink, hard link, ``..``, a glob or folder covering it: file identity,
    :func:`rlflow.data.file_identity.shared_files`), so training prompts are never reported
    as held-out results. ``rlflow train`` checks it when the run evaluates
    (``eval.enabled``); ``rlflow eval --run`` (``offline=True``) always, against the run's
    ``data.path``.

    Raises: ConfigError naming ``eval.path``, both paths and the shared file.
    """
    from rlflow.config.eval import eval_data_config
    from rlflow.data.file_identity import shared_files

    ev = eval_data_config(cfg)
    if not (cfg.eval.enabled or offline) or ev.source == "builtin" \
            or cfg.data.source == "builtin":
        return
    pairs = shared_files(cfg.data.path, ev.path)
    if pairs:
        train, held = pairs[0]
        more = f" (and {len(pairs) - 1} more)" if len(pairs) > 1 else ""
        raise ConfigError(
            f"eval.path: {ev.path!r} reaches the training file {train!r} of data.path="
            f"{cfg.data.path!r} (as {held!r}: the same file, {os.path.realpath(train)!r}){more};"
            f" the held-out prompts must not be the training prompts: give eval.path a file "
            f"that is not read for training")


def check_weights(cfg) -> None:
    """:func:`check_model_weights` of ``model.path`` and, with a teacher, ``teacher.path``."""
    check_model_weights(cfg.model.path, "model.path")
    if cfg.teacher.enabled:
        check_model_weights(cfg.teacher.path, "teacher.path")


def check_model_weights(path: str, field: str = "model.path") -> None:
    """Every safetensors file of the model folder ``path`` (the index's shards, or
    ``model.safetensors``) checked by its header against its size, without reading tensor
    data (:func:`rlflow.models.weight_files.check_weight_files`). Empty ``path``: nothing.

    Raises: ConfigError ``"<field>: <file>: <what is wrong> (expected ...)"``.
    """
    if not path:
        return
    from rlflow.models.config import ModelFormatError
    from rlflow.models.weight_files import check_weight_files

    try:
        check_weight_files(path)
    except ModelFormatError as e:
        raise ConfigError(f"{field}: {e}") from None
    except OSError as e:            # unreadable file: permissions, I/O error
        raise ConfigError(f"{field}: {e.filename or path}: cannot be read ({e.strerror}) "
                          f"(expected a readable safetensors file)") from None
