"""A config from the command line: the config file (default ``configs/demo.py``) plus
``--section.field value`` overrides parsed with tyro, the boolean words every flag accepts
(``true/false/1/0/yes/no/on/off``), the ``--help`` / ``--help-all`` texts, and the refusal of
``--buffer.token`` (argv is visible in ``ps``). Used by ``rlflow train``
(:mod:`rlflow.console.cli`), ``rlflow eval`` (:mod:`rlflow.console.offline_eval`), the TPU scripts'
slice check (:mod:`rlflow.console.slices`) and the hosts' start scripts.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from rlflow.config.validation import FALSE_WORDS, TRUE_WORDS

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CONFIG = os.path.join(REPO_DIR, "configs", "demo.py")

# The flags most runs set, shown by `rlflow train --help` (every field: --help-all or
# docs/config.md). tests/unit/console/test_cli.py checks that each is a config field.
COMMON_FLAGS: tuple[tuple[str, str], ...] = (
    ("name", "run name: the run folder is <run_dir>/<name>"),
    ("run_dir", "folder holding the run folders"),
    ("model.path", "Hugging Face model folder (weights + tokenizer)"),
    ("data.source", "builtin | jsonl | parquet | arrayrecord"),
    ("data.path", "prompt data file, or a glob of files"),
    ("learner.num_steps", "learner steps of the run"),
    ("learner.lr", "learning rate"),
    ("sampler.group_size", "completions per prompt"),
    ("sampler.max_tokens", "longest completion, tokens"),
    ("checkpoint.every_steps", "save every N steps (0: only at exit)"),
    ("checkpoint.resume", "auto | never"),
    ("checkpoint.overwrite", "with resume never: move an earlier run's folder aside"),
    ("buffer.token_file", "ring-buffer token file, mode 0600 (or RLFLOW_BUFFER_TOKEN)"),
    ("metrics.progress", "auto | bar | plain"),
)


def bool_flags(cls=None, prefix: str = "", *, optional: bool = True) -> set[str]:
    """Dotted names of the bool fields of ``ExperimentConfig`` (nested sections included),
    and of its ``Optional[bool]`` fields unless ``optional`` is False."""
    import dataclasses
    import typing

    from rlflow import config as config_mod

    cls = cls or config_mod.ExperimentConfig
    hints = typing.get_type_hints(cls)
    out = set()
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out |= bool_flags(hint, f"{prefix}{f.name}.", optional=optional)
        elif hint is bool or (optional and hint == Optional[bool]):
            out.add(prefix + f.name)
    return out


# the words a bool flag takes (lower case) -> tyro's spelling
BOOL_WORDS = {w: "True" for w in TRUE_WORDS} | {w: "False" for w in FALSE_WORDS}
NONE_WORD = {"none": "None"}                 # Optional[bool] fields only


def normalize_bools(argv: Sequence[str]) -> list[str]:
    """``--section.flag true|false|1|0|yes|no|on|off`` (any case, also ``--flag=value``)
    as tyro's ``True`` / ``False`` (and ``none`` as ``None`` for an ``Optional[bool]``
    field, e.g. ``learner.packing``); a bool flag with no value (last, or before another
    flag) means ``True``.

    Raises:
      SystemExit: another word after a bool flag (exit status 2; stderr names the flag,
        the word and the words it takes)."""
    def spellings(fields):              # --a.b_c and --a.b-c
        return {"--" + n for n in fields} | {"--" + n.replace("_", "-") for n in fields}

    flags = bool_flags()
    names, nullable = spellings(flags), spellings(flags - bool_flags(optional=False))
    out: list[str] = []
    argv = list(argv)
    i = 0
    while i < len(argv):
        word = argv[i]
        key, eq, value = word.partition("=")
        if key in names:
            if not eq:
                if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    value, i = argv[i + 1], i + 1
                else:
                    value = "true"
            parsed = (BOOL_WORDS | NONE_WORD if key in nullable else BOOL_WORDS).get(value.lower())
            if parsed is None:
                words = "true/false, 1/0, yes/no, on/off" + (", none" if key in nullable else "")
                print(f"rlflow train: {key} takes {words} (any case), got {value!r}",
                      file=sys.stderr)
                raise SystemExit(2)
            out += [key, parsed]
        else:
            out.append(word)
        i += 1
    return out


def train_help(default) -> str:
    """The short ``rlflow train --help``: usage, ``--config`` first, the common flags with
    the config file's values, and where every other field is described."""
    lines = ["usage: rlflow train [--config PATH] [--SECTION.FIELD VALUE ...]", "",
             "Train with the config file PATH (default: configs/demo.py), overriding any field",
             "on the command line (booleans take true/false). Examples:",
             "  rlflow train --config configs/gsm8k_qwen2_5_0_5b.py --learner.lr 1e-6",
             "  rlflow train --name try2 --checkpoint.resume never", "",
             "  --config PATH".ljust(34) + "config file defining config() -> ExperimentConfig"]
    for name, meaning in COMMON_FLAGS:
        value = default
        for part in name.split("."):
            value = getattr(value, part)
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        lines.append(f"  --{name.replace('_', '-')}".ljust(34) + f"{meaning} (now: {shown})")
    from rlflow.console.config_docs import flag_count

    lines += ["", f"Every field ({flag_count()}): rlflow train --help-all, or docs/config.md.",
              "The ring-buffer token comes from RLFLOW_BUFFER_TOKEN or --buffer.token_file,",
              "never from the command line."]
    return "\n".join(lines)


def help_all(tyro, default, args: Sequence[str]) -> str:
    """tyro's help of every field (flags with hyphens, as in the README), with booleans
    written ``{true,false}`` / ``(default: true)`` as ``--help`` and the parser take them
    (same-length replacements: tyro's boxes stay aligned)."""
    import contextlib
    import io
    import re

    from rlflow.config import ExperimentConfig

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        tyro.cli(ExperimentConfig, default=default, args=list(args), prog="rlflow train",
                 config=(tyro.conf.FlagConversionOff,))
    text = re.sub(r"\{(None,)?True,False\}", r"{\1true,false}", out.getvalue())
    text = re.sub(r"\(default:(\s+)(True|False)\)",
                  lambda m: f"(default:{m.group(1)}{m.group(2).lower()})", text)
    return text.rstrip("\n")


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

    from rlflow.config import load_config_file
    from rlflow.config.secrets import refuse_secret_flags

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(list(argv))
    refuse_secret_flags(rest)
    path = known.config or DEFAULT_CONFIG
    default = load_config_file(path)
    if any(a in ("-h", "--help") for a in rest):
        # "(now: ...)" shows the config the other flags make (the file's, if they fail)
        others = [a for a in rest if a not in ("-h", "--help", "--help-all")]
        shown, note = default, ""
        if others:
            import contextlib
            import io

            try:
                with contextlib.redirect_stderr(io.StringIO()), \
                        contextlib.redirect_stdout(io.StringIO()):
                    shown = parse_overrides(tyro, default, normalize_bools(others))
            except (SystemExit, ValueError):
                note = ("(the other flags given do not parse: the values shown are the "
                        "config file's)")
        print(train_help(shown) + (f"\n{note}" if note else ""))
        raise SystemExit(0)
    rest = ["--help" if a == "--help-all" else a for a in normalize_bools(rest)]
    if "--help" in rest:
        print(help_all(tyro, _redacted(default), rest))
        raise SystemExit(0)
    return parse_overrides(tyro, default, rest)


def _redacted(cfg):
    """``cfg`` with its buffer token (if any) replaced by ``REDACTED``: tyro prints defaults
    in ``--help-all`` and in its error messages."""
    import dataclasses

    from rlflow.config.secrets import REDACTED

    if not cfg.buffer.token:
        return cfg
    return dataclasses.replace(cfg, buffer=dataclasses.replace(cfg.buffer, token=REDACTED))


def parse_overrides(tyro, default, rest):
    """tyro's parse of the overrides ``rest`` over ``default``; a token set in the config
    file goes in redacted and is put back after parsing (``--buffer.token`` is refused
    before, so the parsed value is always the default)."""
    import dataclasses

    from rlflow.config import ExperimentConfig

    token = default.buffer.token
    cfg = tyro.cli(ExperimentConfig, default=_redacted(default), args=list(rest),
                   prog="rlflow train", config=(tyro.conf.FlagConversionOff,))
    if token:
        cfg = dataclasses.replace(cfg, buffer=dataclasses.replace(cfg.buffer, token=token))
    return cfg
