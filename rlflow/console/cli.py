"""The ``rlflow`` console script: ``rlflow train | export | eval | report | model``.

``rlflow train [--config configs/x.py] [--section.field value ...]`` loads the config
file (default: the built-in demo, ``configs/demo.py``), applies command-line overrides
with tyro, and starts the run. ``rlflow train --help`` lists the common flags;
``--help-all`` every field (also in ``docs/config.md``). Booleans take
``true/false/1/0/yes/no/on/off`` (any case). ``--buffer.token`` is refused (argv is visible
in ``ps``): the token comes from ``RLFLOW_BUFFER_TOKEN`` or ``--buffer.token_file``.
The other sub-commands take their own arguments (``rlflow eval --help``); ``rlflow model
smollm2 [--install]`` builds the SmolLM2-135M-Instruct folder and prints its path. ``rlflow`` alone is ``rlflow train``
on the default config.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

# transformers prints "[transformers] PyTorch was not found ..." when it is imported without
# torch, which rlflow never needs (JAX models; torch only builds the SmolLM2 folder): every
# rlflow command printed it. Set before anything imports transformers; the programs
# inherit it (rlflow.launcher.launch sets it too, for programs started otherwise).
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from rlflow.console.config_args import parse_train_args  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> int:
    console = argv is None              # the console script: the process exits after this
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("train", "export", "eval", "report", "model")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"rlflow: unknown command {argv[0]!r}; expected one of {', '.join(commands)}",
                  file=sys.stderr)
            return 2
        # No sub-command: `rlflow` alone is `rlflow train` on the default config.
        if not argv:
            argv = ["train"]
        else:
            print(__doc__.replace("``", "`"))    # plain text, not reST markup
            return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        from rlflow.config import ConfigError
        from rlflow.config.secrets import SecretError
        try:
            cfg = parse_train_args(rest)
            from rlflow.console.checks import check_runnable, config_warnings
            check_runnable(cfg)         # files, plugins, reward names: before any program
            warnings = config_warnings(cfg)
        except (ConfigError, FileNotFoundError, SecretError) as e:
            print(f"rlflow train: {e}", file=sys.stderr)
            return 2
        for warning in warnings:
            print(f"rlflow train: warning: {warning}", file=sys.stderr, flush=True)
        from rlflow.launcher.supervisor import run_train
        return run_train(cfg)
    if command == "export":
        from rlflow.export.hf_folder import main as export_main
        return export_main(rest, process_exits=console)
    if command == "eval":
        from rlflow.console.offline_eval import main as eval_main
        return eval_main(rest)
    if command == "report":
        from rlflow.run.report import main as report_main
        return report_main(rest)
    if command == "model":
        from rlflow.console.model_folders import main as model_main
        return model_main(rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
