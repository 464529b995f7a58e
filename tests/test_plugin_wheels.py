"""What a third party does, outside our workspace: build kvwire's wheel and plugin wheels
(one made from ``kvwire new-plugin``, filled in with a small working backend; broken ones;
one built for the previous plugin API; one for a future API), install them into a fresh
virtual environment, and use them there.

In that environment:

* ``kvwire --help`` works and ``kvwire plugins`` lists the template's backend with its
  distribution and plugin API, while every broken plugin (an import error, a hook whose
  signature is not the spec's, a name already taken, a future plugin API) is reported with a
  clear reason and breaks nothing else;
* ``--transfer-backend echo`` selects the template's backend for a real cross-process demo,
  every element verified, and the template's own conformance test passes against it;
* a backend built for plugin API 1.0 (it is not thread-safe, as 1.0 allowed) is called the 1.0
  way and passes the concurrent-submitters conformance test; a 1.0 staging strategy is
  refused naming both versions.

Wheels are built and installed with uv from its package cache (the network only for what the
cache lacks). The "small working backend" is kvwire's own tcp engine under another name: this
test proves packaging, discovery, selection and conformance, not a new transport.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest

from kvwire.plugin_api import PLUGIN_API

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ECHO_BACKEND = '''
"""The echo backend: kvwire's tcp engine under another name (a small working backend)."""

from kvwire.backends.tcp import TcpBackend


class EchoBackend(TcpBackend):
    name = "echo"
'''

LEGACY = '''
"""A plugin written before the plugin API had a version (so: API 1.0). Its backend is not
thread-safe, which the 1.0 contract allowed: it fails loudly if two data-path calls overlap."""

import threading

from kvwire.backends.tcp import TcpBackend
from kvwire.plugins import Implementation, hookimpl
from kvwire.staging.direct import DirectStaging


class LegacyBackend(TcpBackend):
    name = "legacy"

    def _guarded(self, fn, *args, **kwargs):
        if not hasattr(self, "_inside"):
            self._inside = threading.Lock()
        if not self._inside.acquire(blocking=False):
            raise RuntimeError("legacy engine entered from two threads at once")
        try:
            return fn(*args, **kwargs)
        finally:
            self._inside.release()

    def _submit(self, *args, **kwargs):
        return self._guarded(super()._submit, *args, **kwargs)

    def _poll(self, *args, **kwargs):
        return self._guarded(super()._poll, *args, **kwargs)


class LegacyStaging(DirectStaging):
    name = "legacy_staging"


@hookimpl
def kvwire_transfer_backends():
    return [Implementation("legacy", "kvwire_legacy:LegacyBackend", "a 1.0 backend")]


@hookimpl
def kvwire_staging_strategies():
    return [Implementation("legacy_staging", "kvwire_legacy:LegacyStaging", "a 1.0 strategy")]
'''

BROKEN = {
    # an engine that is not installed
    "kvwire-broken-import": ("broken_import", "import not_an_installed_engine_xyz\n"),
    # a hook whose signature is not the spec's
    "kvwire-bad-hook": (
        "bad_hook",
        "from kvwire.plugins import hookimpl\n"
        'KVWIRE_PLUGIN_API = "2.0"\n\n@hookimpl\n'
        "def kvwire_transfer_backends(engine_path):\n    return []\n",
    ),
    # a working plugin ...
    "kvwire-twin": (
        "twin",
        "from kvwire.plugins import Implementation, hookimpl\n"
        "from kvwire.backends.tcp import TcpBackend\n"
        'KVWIRE_PLUGIN_API = "2.0"\n\nclass Twin(TcpBackend):\n    name = "twin"\n\n'
        "@hookimpl\ndef kvwire_transfer_backends():\n"
        '    return [Implementation("twin", "twin:Twin")]\n',
    ),
    # ... and one that takes its name, and a built-in's
    "kvwire-dup": (
        "dup",
        "from kvwire.plugins import Implementation, hookimpl\n"
        'KVWIRE_PLUGIN_API = "2.0"\n\n@hookimpl\n'
        "def kvwire_transfer_backends():\n"
        '    return [Implementation("twin", "dup:X"), Implementation("tcp", "dup:Y")]\n',
    ),
    # built for a plugin API this kvwire does not know yet
    "kvwire-future": ("future", 'KVWIRE_PLUGIN_API = "9.0"\n'),
    "kvwire-legacy": ("kvwire_legacy", LEGACY),
}


def uv() -> str:
    found = shutil.which("uv") or str(ROOT / ".tools" / "uv" / "bin" / "uv")
    assert os.access(found, os.X_OK), "uv is needed (./dev.sh installs it into .tools/uv)"
    return found


def run(*cmd: str | Path, cwd: Path = ROOT, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1"}
    env.pop("VIRTUAL_ENV", None)
    out = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )
    if check:
        assert out.returncode == 0, f"{cmd}: {out.stdout}\n{out.stderr}"
    return out


def cached(*cmd: str | Path, cwd: Path = ROOT) -> None:
    """A uv command from the package cache alone, else allowed to reach the index."""
    if run(*cmd, "--offline", cwd=cwd, check=False).returncode != 0:
        run(*cmd, cwd=cwd)


def simple_wheel(root: Path, out: Path, dist: str, module: str, source: str) -> None:
    """A one-module plugin distribution with entry point ``module``, built into ``out``."""
    src = root / dist
    src.mkdir()
    (src / f"{module}.py").write_text(textwrap.dedent(source))
    (src / "pyproject.toml").write_text(
        textwrap.dedent(f"""
        [project]
        name = "{dist}"
        version = "0.1.0"
        dependencies = ["kvwire"]

        [project.entry-points.kvwire]
        {module} = "{module}"

        [build-system]
        requires = ["hatchling>=1.24"]
        build-backend = "hatchling.build"

        [tool.hatch.build.targets.wheel]
        include = ["{module}.py"]
        """)
    )
    cached(uv(), "build", "--wheel", "-q", "-o", out, cwd=src)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fresh environment with every wheel installed; paths by name."""
    root = tmp_path_factory.mktemp("third-party")
    wheels = root / "wheels"
    cached(uv(), "build", "--wheel", "-q", "--package", "kvwire", "-o", wheels)
    echo = root / "kvwire-echo"
    run(sys.executable, "-m", "kvwire.cli", "new-plugin", "echo", "--dir", echo)
    (echo / "src" / "kvwire_echo" / "backend.py").write_text(ECHO_BACKEND)
    cached(uv(), "build", "--wheel", "-q", "-o", wheels, cwd=echo)
    for dist, (module, source) in BROKEN.items():
        simple_wheel(root, wheels, dist, module, source)
    venv = root / "venv"
    run(uv(), "venv", "-q", "-p", sys.executable, venv)
    py = venv / "bin" / "python"
    pins = [f"{p}=={version(p)}" for p in ("pytest", "pytest-timeout")]
    cached(uv(), "pip", "install", "-q", "-p", py, *sorted(wheels.glob("*.whl")), *pins)
    return {"py": py, "kvwire": venv / "bin" / "kvwire", "echo": echo, "root": root}


def test_fresh_environment_is_not_the_workspace(env: dict[str, Path]) -> None:
    where = run(env["py"], "-c", "import kvwire, kvwire_echo; print(kvwire.__file__)")
    assert str(env["root"]) in where.stdout and str(ROOT) not in where.stdout


def test_listing_shows_the_plugin_and_every_broken_one(env: dict[str, Path]) -> None:
    assert "new-plugin" in run(env["kvwire"], "--help").stdout
    out = run(env["kvwire"], "plugins").stdout
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if "│" in line}
    assert "kvwire-echo" in rows["echo"] and PLUGIN_API in rows["echo"] and "ok" in rows["echo"]
    assert "ok" in rows["tcp"] and "kvwire " in rows["tcp"]
    assert "1.0" in rows["legacy"] and "ok" in rows["legacy"]
    assert "ModuleNotFoundError" in rows["(broken_import)"]
    assert "not_an_installed_engine_xyz" in rows["(broken_import)"]
    assert "engine_path" in rows["(bad_hook)"]  # pluggy names the unknown hook argument
    assert "9.0" in rows["(future)"] and PLUGIN_API in rows["(future)"]
    assert "upgrade kvwire" in rows["(future)"]
    # a built-in keeps its name; two plugins with one name make it ambiguous, said so
    assert "'tcp' from dup (kvwire-dup) refused; kept core (kvwire)" in out
    assert "twin" in out and "Uninstall all but one" in rows["twin"]
    bad = run(env["kvwire"], "demo", "--transfer-backend", "twin", "--requests", "1", check=False)
    assert bad.returncode != 0
    said = " ".join(bad.stdout.split())
    assert "transfer backend 'twin' is registered by several plugins" in said
    assert "twin (kvwire-twin)" in said and "dup (kvwire-dup)" in said
    assert "Uninstall all but one" in said


def test_selected_for_a_real_demo(env: dict[str, Path]) -> None:
    out = run(
        env["kvwire"],
        "demo",
        "--transfer-backend",
        "echo",
        *("--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--page-size", "4"),
        *("--requests", "12", "--tokens", "33", "--phases", "2:1", "--concurrency", "4"),
    )
    assert "every element verified" in out.stdout, out.stdout


def pytest_in(env: dict[str, Path], cwd: Path, *args: str | Path) -> str:
    """Run pytest in the fresh environment; its output, once it passed."""
    out = run(
        env["py"], "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, cwd=cwd, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
    return out.stdout


def test_template_conformance_passes_in_the_fresh_environment(env: dict[str, Path]) -> None:
    pytest_in(env, env["echo"], "tests/test_conformance.py")


LEGACY_CHECK = """
import pytest, sys
from kvwire.errors import PluginError
from kvwire.plugins import Kind, get_registry
from kvwire.selection import select_backend, select_staging
from kvwire.config import KVWireConfig

sel = select_backend(KVWireConfig(transfer_backend="legacy"))
assert sel.cls.__name__ == "LegacyBackendSerialised", sel.cls
try:
    select_staging(KVWireConfig(staging="legacy_staging"))
except PluginError as exc:
    print("REFUSED:", exc)
"""

LEGACY_CONFORMANCE = """
from kvwire.testing.conformance import BackendConformance


class TestLegacy(BackendConformance):
    backend_name = "legacy"
"""


def test_a_plugin_built_for_the_previous_api_keeps_working(env: dict[str, Path]) -> None:
    out = run(env["py"], "-c", LEGACY_CHECK).stdout
    assert f"built for kvwire plugin API 1.0; the staging seam changed in {PLUGIN_API}" in out
    test = env["root"] / "test_legacy.py"
    test.write_text(LEGACY_CONFORMANCE)
    pytest_in(env, env["root"], test, "-k", "concurrent_submitters or concurrent_notifications")
