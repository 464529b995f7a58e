"""No source module of any kvwire distribution is over :data:`MAX_LINES` lines.

A module that long holds more than one thing: split it by what its parts hold (see
docs/architecture.md). Every distribution of the workspace is read (``core/src``,
``plugins/*/src``, ``integrations/*/src``); tests, scripts and examples are not source
modules and are not counted. Modules still over the bound when this test was written are
listed in :data:`KNOWN`, with their length then: the test fails on any other module over the
bound, on a listed one that has grown, and on a listed one that is no longer over it (so the
list only shrinks).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The most lines a source module may have.
MAX_LINES = 600

#: Over the bound: none (session/decode.py and session/prefill.py, 756 and 629 lines, became
#: the session/decode/ and session/prefill/ subpackages).
KNOWN: frozenset[str] = frozenset()


def source_roots(root: Path) -> list[Path]:
    """The ``src`` folder of every distribution of the workspace."""
    found = [root / "core" / "src"]
    for group in ("plugins", "integrations"):
        found += sorted(p for p in (root / group).glob("*/src") if p.is_dir())
    return [p for p in found if p.is_dir()]


def long_modules(roots: list[Path], root: Path, limit: int) -> dict[str, int]:
    """``{path relative to root: lines}`` of every ``.py`` file under ``roots`` longer than
    ``limit`` lines."""
    out: dict[str, int] = {}
    for src in roots:
        for path in sorted(src.rglob("*.py")):
            with path.open("rb") as f:
                lines = sum(1 for _ in f)
            if lines > limit:
                out[path.relative_to(root).as_posix()] = lines
    return out


def test_every_distribution_is_read() -> None:
    """The roots cover core and every plugin and integration that has a src folder (a
    distribution missing here would never be measured)."""
    roots = {p.relative_to(ROOT).as_posix() for p in source_roots(ROOT)}
    assert "core/src" in roots
    for group in ("plugins", "integrations"):
        for dist in (ROOT / group).iterdir():
            if (dist / "src").is_dir():
                assert f"{group}/{dist.name}/src" in roots


def test_no_source_module_over_the_bound() -> None:
    found = long_modules(source_roots(ROOT), ROOT, MAX_LINES)
    new = {p: n for p, n in found.items() if p not in KNOWN}
    gone = sorted(set(KNOWN) - set(found))
    assert not new, f"modules over {MAX_LINES} lines: {new}; split them by what they hold"
    assert not gone, f"no longer over {MAX_LINES} lines: remove them from KNOWN: {gone}"


def test_the_check_counts_lines(tmp_path: Path) -> None:
    """A file one line over the bound is found, one at the bound is not, and a file outside
    ``src`` (a test) is never read."""
    src = tmp_path / "plugins" / "demo" / "src" / "demo"
    src.mkdir(parents=True)
    (src / "long.py").write_text("x = 1\n" * 11)
    (src / "fits.py").write_text("x = 1\n" * 10)
    tests = tmp_path / "plugins" / "demo" / "tests"
    tests.mkdir()
    (tests / "test_long.py").write_text("x = 1\n" * 50)
    roots = source_roots(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in roots] == ["plugins/demo/src"]
    assert long_modules(roots, tmp_path, 10) == {"plugins/demo/src/demo/long.py": 11}
