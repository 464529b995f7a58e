"""Shared fixtures for core tests."""

from __future__ import annotations

import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvwire.backends.tcp import TcpBackend, TcpOptions
from kvwire.plugins import reset_registry

#: Makes in-process tcp agents (``make_backend`` fixture).
MakeBackend = Callable[..., TcpBackend]


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


@pytest.fixture
def make_backend() -> Iterator[MakeBackend]:
    """Factory of in-process tcp agents, closed at teardown."""
    made: list[TcpBackend] = []

    def make(name: str | None = None, **options: Any) -> TcpBackend:
        b = TcpBackend(name or f"tcp-{uuid.uuid4().hex[:6]}", TcpOptions(**options))
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


@pytest.fixture
def zctx() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)
