"""Every script the docs run directly, and every shell script with a shebang under scripts/,
is committed executable (git mode 100755): `scripts/xpk/start.sh --dry-run ...` in
docs/tpu.md once failed with `Permission denied` (exit 126) because the xpk scripts were
committed 100644."""

import glob
import os
import re
import subprocess

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# A script path at the start of a command: after a line start, a backtick, a shell prompt
# `$ `, `&&`/`;`/`|`, or environment assignments (`VAR=value `); not after another word such
# as `bash ` (which needs no executable bit) nor inside another path (`"$HOME/rlflow/..."`).
_SCRIPT = re.compile(r"(?<![\w/.$\"'-])(scripts/[\w/.-]+\.sh)\b")


def _git_modes():
    out = subprocess.run(["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    modes = {}
    for line in out.splitlines():
        meta, path = line.split("\t", 1)
        modes[path] = meta.split()[0]
    return modes


def _commands_in(text):
    """(line number, script) for each script a doc line runs directly."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in _SCRIPT.finditer(line):
            before = line[:match.start()]
            # the words of the same command before the script: after the last separator
            segment = re.split(r"`|&&|\|\||;|\||\(|\$ ", before)[-1]
            words = [w for w in segment.split() if not re.fullmatch(r"[A-Za-z_]\w*=\S*", w)]
            if not words:
                found.append((number, match.group(1)))
    return found


def _docs():
    return [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def test_the_parser_finds_direct_runs_and_skips_bash_runs():
    text = ("```\nscripts/a.sh --x\n$ RLFLOW_TOKEN=t scripts/b.sh --dry-run\nbash scripts/c.sh\n"
            "`scripts/d.sh ROLE ...`, then `bash scripts/e.sh`\n"
            "run \"$HOME/rlflow/scripts/f.sh\" start\ncd x && scripts/g.sh\n```\n")
    assert [s for _, s in _commands_in(text)] == [
        "scripts/a.sh", "scripts/b.sh", "scripts/d.sh", "scripts/g.sh"]


def test_every_script_the_docs_run_directly_is_executable_in_git():
    modes = _git_modes()
    direct = []
    for doc in _docs():
        with open(doc, encoding="utf-8") as f:
            for number, script in _commands_in(f.read()):
                direct.append((os.path.relpath(doc, REPO), number, script))
    assert direct, "no directly-run script found in README.md or docs/*.md: the parser broke"
    wrong = [f"{doc}:{number}: {script} is {modes.get(script, 'not in git')}, expected 100755"
             for doc, number, script in direct if modes.get(script) != "100755"]
    assert not wrong, "\n".join(wrong)


def test_every_shell_script_with_a_shebang_under_scripts_is_executable_in_git():
    modes = _git_modes()
    scripts = []
    for path, mode in modes.items():
        if not (path.startswith("scripts/") and path.endswith(".sh")):
            continue
        with open(os.path.join(REPO, path), "rb") as f:
            if f.read(2) == b"#!":
                scripts.append((path, mode))
    if not scripts:
        pytest.fail("no shell script with a shebang under scripts/: the scan broke")
    wrong = [f"{path} is {mode}, expected 100755" for path, mode in scripts if mode != "100755"]
    assert not wrong, "\n".join(wrong)
