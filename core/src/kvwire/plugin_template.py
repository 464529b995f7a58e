"""``kvwire new-plugin NAME``: the starting point of a third-party backend plugin.

Writes a small package (``kvwire-NAME``): a pyproject with the entry point and a compatible
``kvwire`` version range, the hook module (declaring the plugin API it is written for), a
backend skeleton whose every hook says what to implement, the conformance and cluster tests,
and a README. The generated package builds as is (``uv build``); its tests pass once the
backend's hooks are implemented (docs/writing-a-backend-plugin.md).
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from kvwire.errors import ConfigError
from kvwire.plugin_api import PLUGIN_API

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
#: Names core (or our own plugins) already take.
_TAKEN = {"tcp", "nixl", "mooncake", "auto", "core"}


def kvwire_range() -> str:
    """The ``kvwire`` requirement a plugin built against this kvwire declares: this release
    up to the next minor (a new minor may change the plugin API)."""
    try:
        ours = version("kvwire")
    except PackageNotFoundError:  # running from a source tree without metadata
        ours = "0.1.0"
    major, minor = (int(x) for x in ours.split(".")[:2])
    return f"kvwire>={ours},<{major}.{minor + 1}"


def _class_name(name: str) -> str:
    return "".join(p.capitalize() for p in name.split("_")) + "Backend"


def files(name: str) -> dict[str, str]:
    """Relative path -> content of the package for backend ``name``."""
    pkg = f"kvwire_{name}"
    cls = _class_name(name)
    dist = f"kvwire-{name.replace('_', '-')}"
    return {
        "pyproject.toml": f'''[project]
name = "{dist}"
version = "0.1.0"
description = "The {name} transfer backend for kvwire."
readme = "README.md"
requires-python = ">=3.11"
dependencies = ["{kvwire_range()}", "numpy>=1.26", "pydantic>=2.6,<3"]

[project.optional-dependencies]
test = ["pytest>=8", "pytest-timeout>=2.3"]

# kvwire finds the plugin through this entry point (group "kvwire"); the module must import
# fast and must not import the native engine.
[project.entry-points.kvwire]
{name} = "{pkg}.plugin"

[build-system]
requires = ["hatchling>=1.24"]
build-backend = "hatchling.build"

[tool.hatch.build.targets.wheel]
packages = ["src/{pkg}"]
''',
        f"src/{pkg}/__init__.py": f'"""The {name} transfer backend for kvwire."""\n',
        f"src/{pkg}/py.typed": "",
        f"src/{pkg}/plugin.py": f'''"""kvwire hook module of {dist} (entry point ``{name}``).

It names the backend and never imports the engine: a broken engine install must not break
``kvwire --help`` or the other backends."""

from kvwire.hookspecs import Implementation, hookimpl

#: The kvwire plugin API this plugin is written for (kvwire refuses to load it
#: when it is not compatible, naming both versions).
KVWIRE_PLUGIN_API = "{PLUGIN_API}"


@hookimpl
def kvwire_transfer_backends() -> list[Implementation]:
    """The ``{name}`` backend (selected with ``--transfer-backend {name}``)."""
    target = "{pkg}.backend:{cls}"
    return [Implementation("{name}", target, "the {name} transfer engine")]
''',
        f"src/{pkg}/backend.py": f'''"""The {name} transfer backend.

Implement every hook below; the public methods of :class:`kvwire.backend.TransferBackend`
validate all input before a hook runs, and its docstrings give the lock contract (which hooks
may run concurrently)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvwire.backend import (
    BackendCapabilities,
    DescTable,
    Notification,
    PreparedPair,
    TransferBackend,
    TransferHandle,
    XferOp,
    XferState,
)
from kvwire.layout import MemoryRegion

TODO = "{cls}: implement this hook (see docs/writing-a-backend-plugin.md)"


class {cls}Options(BaseModel):
    """Options of ``--transfer-backend {name}``
    (``--transfer-backend-option key=value``)."""

    model_config = ConfigDict(extra="forbid")


class {cls}(TransferBackend):
    """The {name} transfer engine behind kvwire's backend contract."""

    name = "{name}"
    capabilities = BackendCapabilities(write=True, notifications=True, dram=True)
    options_model = {cls}Options

    def _register(self, regions: list[MemoryRegion]) -> None:
        raise NotImplementedError(TODO)

    def _deregister(self, regions: list[MemoryRegion]) -> None:
        raise NotImplementedError(TODO)

    def local_metadata(self) -> bytes:
        raise NotImplementedError(TODO)

    def _peer_name(self, metadata: bytes) -> str:
        raise NotImplementedError(TODO)

    def _add_peer(self, name: str, metadata: bytes) -> None:
        raise NotImplementedError(TODO)

    def _remove_peer(self, peer: str) -> None:
        raise NotImplementedError(TODO)

    def peers(self) -> list[str]:
        raise NotImplementedError(TODO)

    def _peer_regions(self, peer: str) -> Sequence[MemoryRegion] | None:
        return None  # or the peer's registered regions, to refuse bad rows at prepare

    def _prepare(self, pair: PreparedPair, local: DescTable, remote: DescTable) -> Any:
        raise NotImplementedError(TODO)

    def _submit(
        self,
        op: XferOp,
        pair: PreparedPair,
        local_idx: Any,
        remote_idx: Any,
        notification: bytes | None,
        handle: TransferHandle,
    ) -> Any:
        raise NotImplementedError(TODO)

    def _poll(self, handle: TransferHandle) -> XferState:
        raise NotImplementedError(TODO)

    def get_notifications(self) -> list[Notification]:
        raise NotImplementedError(TODO)

    def _close(self) -> None:
        pass
''',
        "tests/test_conformance.py": f'''"""kvwire's conformance suites against the {name}
backend."""

from kvwire.testing.conformance import BackendConformance, MapperConformance


class Test{cls}Conformance(BackendConformance):
    backend_name = "{name}"


class Test{cls}MapperConformance(MapperConformance):
    backend_name = "{name}"
''',
        "tests/test_cluster.py": f'''"""kvwire's control plane end to end over the {name}
backend: real prefill and decode processes, every element verified."""

from kvwire.testing.cluster_suite import ClusterConformance, ClusterFailures


class Test{cls}Cluster(ClusterConformance):
    backend_name = "{name}"
    topologies = ("equal-2to2", "gather-2to1", "scatter-1to2")


class Test{cls}ClusterFailures(ClusterFailures):
    backend_name = "{name}"
''',
        "README.md": f"""# {dist}

The `{name}` transfer backend for [kvwire](https://pypi.org/project/kvwire/).

```bash
uv pip install -e '.[test]'        # or: pip install -e '.[test]'
kvwire plugins                     # lists `{name}`, its distribution and plugin API
pytest                             # kvwire's conformance and cluster suites
kvwire demo --transfer-backend {name}
```

Start with `src/{pkg}/backend.py`: every hook raises `NotImplementedError` until written.
`kvwire.backend.TransferBackend` documents each hook and the lock contract (the data-path
hooks run concurrently). The plugin declares the kvwire plugin API it is written for
(`KVWIRE_PLUGIN_API` in `src/{pkg}/plugin.py`, now {PLUGIN_API}) and a compatible `kvwire`
version range in `pyproject.toml`; kvwire refuses an incompatible plugin at load, naming both
versions.
""",
    }


def write_plugin(name: str, dest: Path, force: bool = False) -> list[Path]:
    """Write the template for backend ``name`` into ``dest`` (created); returns the files.
    Refuses a bad or taken name, and a non-empty ``dest`` unless ``force``."""
    if not _NAME.match(name):
        raise ConfigError(
            f"plugin name {name!r}: use lowercase letters, digits and '_', starting with a "
            "letter (at most 32 characters)"
        )
    if name in _TAKEN:
        raise ConfigError(f"plugin name {name!r} is taken by kvwire or its plugins; pick another")
    if dest.exists() and any(dest.iterdir()) and not force:
        raise ConfigError(f"{dest} exists and is not empty; choose another --dir or pass --force")
    written = []
    for rel, text in files(name).items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
