"""The floors of rlflow (DESIGN.md, "Floors"): a module imports only from its own floor or below.

Pure ast: every ``import rlflow...`` and ``from rlflow... import ...`` in ``rlflow/`` is read,
module-level and function-level alike, relative imports resolved against the importing
module. Each import is mapped to the folder it lands in (a top-level module such as
``rlflow/mesh.py`` is its own place), and the folder to its floor in :data:`FLOORS`.
The checks: no import runs up the floors (nor between ``sampler/`` and ``learner/``), the
module -> module graph has no circle, and every folder and top-level module of ``rlflow/`` has
a place in the table (issue 49, item 2). Each failure names ``file:line``, the imported module
and both floors, or the modules of the circle.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

# Ground up; a place is a folder of rlflow/ or a top-level module ("mesh" is rlflow/mesh.py).
# "" is the package root (rlflow/__init__.py).
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ground", ("", "system", "mesh")),
    ("config", ("config",)),
    ("models, data, run", ("models", "data", "run")),
    ("exchange, checkpoint, envs, eval", ("exchange", "checkpoint", "envs", "eval")),
    ("contract between the programs, export", ("control", "export")),
    ("programs", ("sampler", "learner", "gateway")),
    ("launcher", ("launcher",)),
    ("console", ("console",)),
)

# Places on one floor that must not import each other (DESIGN.md: neither imports the other).
APART: tuple[tuple[str, str], ...] = (("sampler", "learner"),)

from repo_paths import REPO

ROOT = pathlib.Path(REPO) / "rlflow"
assert (ROOT / "__init__.py").is_file(), f"not the rlflow package: {ROOT}"


@dataclasses.dataclass(frozen=True)
class Import:
    """One rlflow import: ``file:line`` of ``module`` imports ``target`` (a dotted module)."""

    file: str
    line: int
    module: str
    target: str


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    """The dotted name of ``path`` in the package at ``root`` (``rlflow.x.y``; a package's
    ``__init__.py`` is the package itself)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([root.name, *parts])


def resolve_target(root: pathlib.Path, dotted: str) -> str:
    """The module ``dotted`` names, or its parent when ``dotted`` is a name inside a module
    (``from rlflow.x import y`` where ``y`` is a function: the import lands in ``rlflow.x``)."""
    parts = dotted.split(".")
    while len(parts) > 1:
        rel = pathlib.Path(*parts[1:])
        if (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file():
            return ".".join(parts)
        parts = parts[:-1]
    return parts[0]


def imports_of(root: pathlib.Path, path: pathlib.Path) -> list[Import]:
    """Every import of the package ``root.name`` in ``path`` (all levels of the tree,
    relative imports resolved). Raises SyntaxError naming the file if it does not parse."""
    pkg = root.name
    module = module_name(root, path)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[Import] = []
    rel_file = str(path.relative_to(root.parent))

    def add(line: int, dotted: str) -> None:
        if dotted == pkg or dotted.startswith(pkg + "."):
            found.append(Import(rel_file, line, module, resolve_target(root, dotted)))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            for alias in node.names:
                add(node.lineno, f"{stem}.{alias.name}" if alias.name != "*" else stem)
    return found


def place_of(module: str) -> str:
    """The place of a dotted module: its first folder below the package, or the top-level
    module's name, or "" for the package root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def floor_index(floors=FLOORS) -> dict[str, int]:
    return {place: i for i, (_, places) in enumerate(floors) for place in places}


def all_imports(root: pathlib.Path) -> list[Import]:
    return [imp for path in sorted(root.rglob("*.py")) for imp in imports_of(root, path)]


def upward_imports(root: pathlib.Path, floors=FLOORS, apart=APART) -> list[str]:
    """``file:line imports name (floor X) from floor Y`` for every import that runs up the
    floors or crosses between two places kept apart."""
    index = floor_index(floors)
    names = [name for name, _ in floors]
    apart_pairs = {frozenset(pair) for pair in apart}
    errors: list[str] = []
    for imp in all_imports(root):
        src, dst = place_of(imp.module), place_of(imp.target)
        if src not in index or dst not in index:
            continue  # reported by unplaced_folders
        apart_ = src != dst and frozenset((src, dst)) in apart_pairs
        if index[dst] > index[src] or apart_:
            errors.append(
                f"{imp.file}:{imp.line} imports {imp.target} (floor {names[index[dst]]}) "
                f"from floor {names[index[src]]}"
            )
    return list(dict.fromkeys(errors))   # one line per import (``from x import a, b``)


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """module -> the modules it imports (written imports only)."""
    edges: dict[str, set[str]] = {}
    for imp in all_imports(root):
        edges.setdefault(imp.module, set()).add(imp.target)
        edges.setdefault(imp.target, set())
    return edges


def shortest_circle(edges: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first module (breadth-first inside the
    component): ``[a, b, ..., a]``."""
    start, inside = component[0], set(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(edges[node] & inside):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if nxt not in parent:
                    parent[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no circle through {start}")  # a component always has one


def import_circles(root: pathlib.Path) -> list[list[str]]:
    """The circles of the module -> module import graph: for each of Tarjan's strongly
    connected components of more than one module (or a module importing itself), a
    shortest circle through its first module in sorted order, ``[a, b, ..., a]``."""
    edges = import_graph(root)
    index_of: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:  # iterative Tarjan (no recursion limit on big trees)
        nonlocal counter
        work = [(start, iter(sorted(edges[start])))]
        index_of[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index_of:
                    index_of[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index_of[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index_of[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    circles.append(sorted(component))

    for module in sorted(edges):
        if module not in index_of:
            visit(module)
    return [shortest_circle(edges, component) for component in sorted(circles)]


def unplaced_folders(root: pathlib.Path, floors=FLOORS) -> list[str]:
    """Folders and top-level modules of the package that the floor table does not place."""
    index = floor_index(floors)
    places = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    places |= {p.stem for p in root.glob("*.py") if p.name != "__init__.py"}
    return sorted(place for place in places if place not in index)


def test_no_upward_import():
    errors = upward_imports(ROOT)
    assert not errors, "imports that run up the floors:\n" + "\n".join(errors)


def test_no_import_circle():
    circles = import_circles(ROOT)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_every_folder_has_a_floor():
    missing = unplaced_folders(ROOT)
    assert not missing, f"folders of rlflow/ not placed in FLOORS: {missing}"


def test_the_table_names_only_existing_places():
    places = {p.name for p in ROOT.iterdir() if p.is_dir()} | {p.stem for p in ROOT.glob("*.py")}
    stale = [place for _, names in FLOORS for place in names if place and place not in places]
    assert not stale, f"FLOORS names places that rlflow/ does not have: {stale}"


def _write(root: pathlib.Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def toy(tmp_path):
    """A package ``pkg`` with floors low -> high and a handful of imports."""
    root = tmp_path / "pkg"
    _write(root, "__init__.py", "")
    _write(root, "low/__init__.py", "")
    _write(root, "high/__init__.py", "")
    _write(root, "high/a.py", "from pkg.low import b\n")  # downward: fine
    _write(root, "low/b.py", "import os\n\ndef f():\n    from ..high import a\n")  # upward
    _write(root, "low/c.py", "from . import d\n")  # c <-> d circle, same floor
    _write(root, "low/d.py", "from pkg.low.c import thing\n")
    return root


TOY_FLOORS = (("low", ("", "low")), ("high", ("high",)))


def test_checker_reports_an_upward_function_level_relative_import(toy):
    errors = upward_imports(toy, TOY_FLOORS, apart=())
    assert errors == ["pkg/low/b.py:4 imports pkg.high.a (floor high) from floor low"]


def test_checker_reports_a_circle(toy):
    assert import_circles(toy) == [["pkg.high.a", "pkg.low.b", "pkg.high.a"],
                                   ["pkg.low.c", "pkg.low.d", "pkg.low.c"]]


def test_checker_reports_a_longer_circle_and_a_self_import(tmp_path):
    root = tmp_path / "pkg"
    _write(root, "__init__.py", "")
    _write(root, "a.py", "import pkg.b\n")
    _write(root, "b.py", "from pkg import c\n")
    _write(root, "c.py", "def f():\n    from . import a\n")
    _write(root, "d.py", "import pkg.d\n")
    _write(root, "e.py", "import pkg.a\n")          # into the circle, not on it
    assert import_circles(root) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"], ["pkg.d", "pkg.d"]]


def test_checker_reports_places_kept_apart(toy):
    _write(toy, "side/__init__.py", "")
    _write(toy, "side/e.py", "import pkg.high.a\n")
    floors = (("low", ("", "low")), ("high", ("high", "side")))
    errors = upward_imports(toy, floors, apart=(("high", "side"),))
    assert "pkg/side/e.py:1 imports pkg.high.a (floor high) from floor high" in errors


def test_checker_reports_an_unplaced_folder(toy):
    _write(toy, "stray/__init__.py", "")
    _write(toy, "loose.py", "")
    assert unplaced_folders(toy, TOY_FLOORS) == ["loose", "stray"]
