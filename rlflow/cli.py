"""The ``rlflow`` console script: ``rlflow train | export | report``.

``rlflow train [--config configs/x.py] [--section.field value ...]`` loads the config
file (default: the built-in demo, ``configs/demo.py``), applies command-line overrides
with tyro, and starts the run. The other sub-commands take their own tyro arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "configs", "demo.py")


def parse_train_args(argv: Sequence[str]):
    """Return the ExperimentConfig for ``rlflow train`` arguments.

    ``--config PATH`` picks the config file; every other argument is a tyro override of
    a field of that config (``--learner.lr 1e-6``).

    Raises:
      FileNotFoundError: the config file does not exist.
      rlflow.config.ConfigError: an override makes the config invalid (names the field).
      SystemExit: tyro rejects an unknown flag (its message lists the valid ones).
    """
    import tyro

    from rlflow.config import ExperimentConfig, load_config_file

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(list(argv))
    path = known.config or DEFAULT_CONFIG
    default = load_config_file(path)
    return tyro.cli(ExperimentConfig, default=default, args=rest,
                    prog="rlflow train", config=(tyro.conf.FlagConversionOff,))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("train", "export", "report")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"rlflow: unknown command {argv[0]!r}; expected one of {', '.join(commands)}",
                  file=sys.stderr)
            return 2
        # No sub-command: `rlflow` alone is `rlflow train` on the default config.
        if not argv:
            argv = ["train"]
        else:
            print(__doc__)
            return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        from rlflow.config import ConfigError
        try:
            cfg = parse_train_args(rest)
            from rlflow.config_checks import check_runnable
            check_runnable(cfg)         # files, plugins, reward names: before any program
        except (ConfigError, FileNotFoundError) as e:
            print(f"rlflow train: {e}", file=sys.stderr)
            return 2
        from rlflow.launch import run_train
        return run_train(cfg)
    if command == "export":
        from rlflow.export import main as export_main
        return export_main(rest)
    if command == "report":
        from rlflow.report import main as report_main
        return report_main(rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
