"""kvwire's import graph has no circles, counting every import statement wherever it stands
(module level, under ``TYPE_CHECKING``, inside functions): a lazy or type-only import still
couples the two modules, it only hides the circle from the interpreter.

The graph is read from the sources with :mod:`ast` (nothing is imported), modules and
packages alike, and reduced to strongly connected components (Tarjan). Circles that existed
when this test was written are listed in :data:`KNOWN`: the test fails on any other circle,
and on a listed one that has grown or that is gone (so the list only shrinks, and is emptied
by the session-layer redesign of issue 25). Nothing in the session layer imports its façade
(:data:`FACADE`): sides, links and workers get the rank context and the room table instead.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

#: Circles still to dissolve: none (the session layer's circle went with issue 25's redesign,
#: the two pairs outside it with the "shape" branch); the test fails on any circle.
KNOWN: frozenset[frozenset[str]] = frozenset()

#: The session layer's façade: the only module that builds the sides, and the only one
#: (with the package's ``__init__``, which re-exports the engine API) that may import it.
FACADE = "kvwire.session.manager"


def module_files(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module and package under ``src/package``."""
    out: dict[str, Path] = {}
    for path in (src / package).rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports (any statement, anywhere)."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                # ``from pkg import sub`` names the submodule when there is one.
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            for t in targets:
                o = owner(t)
                if o is not None and o != mod:
                    edges[mod].add(o)
    return edges


def circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one node (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.add(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        found.append(frozenset(comp))
    return found


def test_no_new_import_circle() -> None:
    found = set(circles(import_edges(module_files(SRC, "kvwire"))))
    new = [sorted(c) for c in found - KNOWN]
    gone = [sorted(c) for c in KNOWN - found]
    assert not new, f"import circles inside kvwire: {new}"
    assert not gone, f"circles dissolved (or changed): remove them from KNOWN: {gone}"


def test_no_package_circle() -> None:
    """Between kvwire's subpackages and top-level modules (``kvwire.control``,
    ``kvwire.session``, ``kvwire.layout``, ...) there is no circle at all."""
    edges = import_edges(module_files(SRC, "kvwire"))
    top = {".".join(m.split(".")[:2]) for m in edges}
    packages: dict[str, set[str]] = {p: set() for p in top}
    for mod, targets in edges.items():
        a = ".".join(mod.split(".")[:2])
        packages[a] |= {".".join(t.split(".")[:2]) for t in targets} - {a}
    assert circles(packages) == []


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """A circle made only of a ``TYPE_CHECKING`` import and a function-level relative import
    is found (the checker is not fooled by imports the interpreter defers)."""
    pkg = tmp_path / "demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from demo.b import B\n"
    )
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("import demo.a\n")
    found = circles(import_edges(module_files(tmp_path, "demo")))
    assert found == [frozenset({"demo.a", "demo.b"})]


def test_no_session_module_reaches_into_the_facade() -> None:
    """Below the façade, no session module imports ``manager.py`` (in any form: module level,
    ``TYPE_CHECKING``, inside a function), nor names ``KVManager`` in its code: state is
    passed down (``RankContext``, ``RoomTable``), never reached up for."""
    modules = module_files(SRC, "kvwire")
    edges = import_edges(modules)
    below = [m for m in modules if m.startswith("kvwire.session.") and m != FACADE]
    assert below, "no session modules found"
    importers = sorted(m for m in below if FACADE in edges[m])
    assert not importers, f"session modules importing the façade {FACADE}: {importers}"
    naming = []
    for mod in below:
        tree = ast.parse(modules[mod].read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        if "KVManager" in names or "mgr" in names:
            naming.append(mod)
    assert not naming, f"session modules naming KVManager (or a `mgr`) in code: {naming}"


def test_the_facade_check_sees_a_type_only_import(tmp_path: Path) -> None:
    """The façade check counts a ``TYPE_CHECKING`` import of the façade as a reach."""
    pkg = tmp_path / "kvwire" / "session"
    pkg.mkdir(parents=True)
    (tmp_path / "kvwire" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from kvwire.session.manager import KVManager\n")
    (pkg / "manager.py").write_text("from kvwire.session.side import Side\n")
    (pkg / "side.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from kvwire.session.manager import KVManager\n"
    )
    edges = import_edges(module_files(tmp_path, "kvwire"))
    assert FACADE in edges["kvwire.session.side"]
    assert FACADE in edges["kvwire.session"]  # allowed: the package re-exports the engine API
