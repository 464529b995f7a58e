"""Shared fixtures for core tests."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.plugins import reset_registry


def make_fake_distribution(
    root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]
) -> None:
    """Write an installed-looking distribution (dist-info + modules) under ``root``."""
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    eps = "[kvwire]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(eps)
    for name, src in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(src))


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on sys.path for fake plugin distributions; the registry is reset around."""
    sys.path.insert(0, str(tmp_path))
    reset_registry()
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for mod in [m for m in sys.modules if m.startswith("fakeplug")]:
        del sys.modules[mod]
    reset_registry()


@pytest.fixture
def make_dist(plugin_dir: Path) -> object:
    """Factory writing fake distributions into :func:`plugin_dir`."""

    def make(dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
        make_fake_distribution(plugin_dir, dist, entry_points, modules)

    return make
