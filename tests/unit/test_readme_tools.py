"""Every tool the README tells the user to run is installed by the set-up it describes
(issue 49, fault 9): the README gives ``tensorboard --logdir runs``, but ``tensorboard`` was
only in the test extra, so after ``scripts/demo.sh`` (the runtime install) it was not there.

A command's tool is its first word (after a prompt, ``VAR=value`` and ``.venv/bin/``); a tool
that is a Python console script (an installed distribution's entry point) must come from a
distribution in setup.py's runtime requirements, or in an extra that the README installs
with ``pip install -e ".[NAME]"`` (not the test extra, which no user set-up installs).
"""

import ast
import importlib.metadata
import os
import re

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# the installers and interpreters the set-up itself provides
BASICS = {"pip", "pip3", "python", "python3", "rlflow"}


def _setup_requirements():
    """(runtime requirement names, {extra: requirement names}) from setup.py, by reading it
    (setup() is not run)."""
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    lists = {}
    extras = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            lists[node.targets[0].id] = ast.literal_eval(node.value)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup":
            for kw in node.keywords:
                if kw.arg == "install_requires":
                    runtime_name = kw.value.id
                if kw.arg == "extras_require":
                    extras = {k.value: v.id for k, v in zip(kw.value.keys, kw.value.values)}
    names = lambda reqs: {_norm(re.split(r"[\[<>=!~; ]", r, 1)[0]) for r in reqs}
    return names(lists[runtime_name]), {k: names(lists[v]) for k, v in extras.items()}


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _commands(text):
    """First words of the commands in backticks and in fenced code blocks."""
    spans = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    lines = [line for block in spans for line in block.splitlines()]
    lines += re.findall(r"(?<!`)`([^`\n]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.S))
    firsts = set()
    for line in lines:
        words = [w for w in line.strip().lstrip("$ ").split()
                 if not re.fullmatch(r"[A-Za-z_]\w*=\S*", w)]
        if len(words) > 1 and words[1] in ("=", "+=") or not words:
            continue                              # Python in a code block, not a command
        if not words[0].startswith("#"):
            firsts.add(words[0].rsplit(".venv/bin/", 1)[-1])
    return firsts


def test_the_readme_commands_tools_are_installed_by_its_set_up():
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    runtime, extras = _setup_requirements()
    user_extras = set(re.findall(r'pip install -e "\.\[(\w+)\]"', text)) - {"test"}
    allowed = runtime | {n for e in user_extras for n in extras.get(e, ())}
    scripts = {ep.name: _norm(ep.dist.name)
               for ep in importlib.metadata.entry_points(group="console_scripts")}
    tools = {w: scripts[w] for w in _commands(text) if w in scripts and w not in BASICS}
    assert "tensorboard" in tools, tools        # the scan finds the README's commands
    missing = {w: dist for w, dist in tools.items() if dist not in allowed}
    assert not missing, (f"the README runs {sorted(missing)}, whose distributions "
                         f"{sorted(set(missing.values()))} no user set-up installs "
                         "(setup.py RUNTIME or a README-installed extra)")
