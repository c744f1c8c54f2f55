"""Files stay small enough to read in one sitting (DESIGN.md, rules of thumb): no module of
rlflow over 500 lines, no function in rlflow/learner and rlflow/models over 100 lines (a
nested function counts on its own and inside the function that holds it). The failure names
each offender as ``path:lines`` or ``path:function:lines``."""

import ast
import pathlib

import pytest

from repo_paths import REPO

ROOT = pathlib.Path(REPO) / "rlflow"
assert (ROOT / "__init__.py").is_file(), f"not the rlflow package: {ROOT}"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 100
FUNCTION_FOLDERS = ("learner", "models")


def module_lines() -> dict:
    """``{path relative to rlflow/: line count}`` of every module."""
    return {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
            for p in sorted(ROOT.rglob("*.py"))}


def long_functions(source: str, path: str, limit: int) -> list:
    """``path:function:lines`` of every function (or method, nested ones too) of ``source``
    longer than ``limit`` lines, from its ``def`` (or first decorator) to its last line."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            n = node.end_lineno - first + 1
            if n > limit:
                out.append(f"{path}:{node.name}:{n}")
    return out


def test_no_module_over_500_lines():
    lines = module_lines()
    over = sorted(p for p, n in lines.items() if n > MAX_MODULE_LINES)
    assert over == [], "modules over 500 lines: " + ", ".join(f"rlflow/{p}:{lines[p]}"
                                                              for p in over)


@pytest.mark.parametrize("folder", FUNCTION_FOLDERS)
def test_no_function_over_100_lines(folder):
    long = [f for p in sorted((ROOT / folder).rglob("*.py"))
            for f in long_functions(p.read_text(), f"rlflow/{p.relative_to(ROOT).as_posix()}",
                                    MAX_FUNCTION_LINES)]
    assert long == [], "functions over 100 lines (path:function:lines): " + ", ".join(long)


def test_the_length_check_counts_what_it_says():
    """The checker itself: a 101-line function (decorator included) is reported with its
    name and length, a 100-line one and a class body are not; nested functions count."""
    body = "    x = 1\n" * 98
    src = (f"@staticmethod\ndef big():\n{body}    return x\n\n"
           f"def ok():\n{body}    return x\n\n"
           f"class C:\n    def m(self):\n        def inner():\n"
           + "            y = 1\n" * 100 + "        return inner\n")
    assert long_functions(src, "f.py", 100) == ["f.py:big:101", "f.py:m:103", "f.py:inner:101"]
