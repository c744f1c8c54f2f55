"""The config reference in docs/config.md is generated from the dataclasses and current."""

import dataclasses
import os

from rlflow import config as config_mod
from rlflow.console.config_docs import SECTIONS, field_descriptions, render_markdown, undocumented_fields

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def test_every_field_is_documented():
    assert undocumented_fields() == []


def test_committed_reference_is_current():
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        committed = f.read()
    assert committed == render_markdown(), \
        "docs/config.md is stale: run `python -m rlflow.console.config_docs > docs/config.md`"


def test_parser_reads_multi_name_and_continuation_entries():
    @dataclasses.dataclass
    class Example:
        """Doc.

        Attributes:
          a, b: first
            continued.
          c / d:
            on the next line.
          e: last.
        """
        a: int = 0
        b: int = 0
        c: int = 0
        d: int = 0
        e: int = 0

    got = field_descriptions(Example)
    assert got == {"a": "first continued.", "b": "first continued.",
                   "c": "on the next line.", "d": "on the next line.", "e": "last."}


def test_reference_lists_every_section_and_flag():
    text = render_markdown()
    sections = {cls for _, cls in SECTIONS}
    assert config_mod.LearnerConfig in sections and config_mod.SamplerConfig in sections
    assert "`--learner.lr`" in text and "`--sampler.group-size`" in text


def test_reference_and_help_all_list_the_same_flags():
    """Every flag of ``rlflow train --help-all`` is in the reference (both places of a shared
    section: sampler.mesh and learner.mesh) and the other way round; flag_count (shown by
    ``--help``) is their number."""
    import re

    import tyro

    from rlflow.console.config_args import help_all
    from rlflow.config import ExperimentConfig
    from rlflow.console.config_docs import flag_count

    text = help_all(tyro, ExperimentConfig(), ["--help"])
    in_help = {f.replace("_", "-")
               for f in re.findall(r"^[\s│]*(--[a-z][a-z0-9_.-]*)", text, re.MULTILINE)}
    in_help -= {"--help"}
    rows = [line.split("|")[1] for line in render_markdown().splitlines()
            if line.startswith("| `--")]
    in_doc = [f.strip().strip("`") for row in rows for f in row.split(",")]
    assert set(in_doc) == in_help, (sorted(set(in_doc) - in_help),
                                    sorted(in_help - set(in_doc)))
    assert {"--learner.mesh.fsdp", "--sampler.mesh.fsdp", "--seed"} <= in_help
    assert flag_count() == len(in_doc) == len(set(in_doc))
