"""Plugin discovery: entry points, pluggy hooks, broken plugins, duplicates, unknown names."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvwire.backends.tcp import TcpBackend
from kvwire.config import KVWireConfig
from kvwire.errors import PluginError, UnknownNameError
from kvwire.plugins import Kind, PluginRegistry, get_registry
from kvwire.selection import select_backend

MakeDist = Callable[[str, dict[str, str], dict[str, str]], None]


GOOD_PLUGIN = """
from kvwire.plugins import Implementation, hookimpl

@hookimpl
def kvwire_transfer_backends():
    return [Implementation("fakenative", "fakeplug_native_engine:Backend", priority=1000),
            Implementation("tcp", "fakeplug_good:NotTcp")]

@hookimpl
def kvwire_index_mappers():
    return [Implementation("dupmapper", "fakeplug_good:X")]

@hookimpl
def kvwire_engine_benchmarks():
    return [Implementation("fakenative-bench", "json:dumps"),
            Implementation("brokenbench", "fakeplug_no_such_module:main")]
"""

OTHER_PLUGIN = """
from kvwire.plugins import Implementation, hookimpl

@hookimpl
def kvwire_doctor_checks():
    raise RuntimeError("engine probe crashed")

@hookimpl
def kvwire_index_mappers():
    return [Implementation("dupmapper", "fakeplug_other:Y")]
"""

BROKEN_PLUGIN = """
raise ImportError("libfake_engine.so: cannot open shared object file")
"""


@pytest.fixture
def fake_plugins(plugin_dir: Path, make_dist: MakeDist) -> Path:
    make_dist("fakeplug-good", {"good": "fakeplug_good"}, {"fakeplug_good": GOOD_PLUGIN})
    make_dist("fakeplug-other", {"other": "fakeplug_other"}, {"fakeplug_other": OTHER_PLUGIN})
    make_dist(
        "fakeplug-broken", {"brokenengine": "fakeplug_broken"}, {"fakeplug_broken": BROKEN_PLUGIN}
    )
    return plugin_dir


def test_builtins_register_through_entry_point() -> None:
    reg = PluginRegistry()

    def builtin(kind: Kind) -> list[str]:  # engine plugins of this workspace may be installed
        return [n for n in reg.names(kind) if reg.get(kind, n).builtin]

    assert builtin(Kind.BACKEND) == ["tcp"]
    assert builtin(Kind.MAPPER) == ["equal_tp", "head_rows", "head_slice", "mla"]
    assert builtin(Kind.STAGING) == ["bulk", "direct"]
    entry = reg.get(Kind.BACKEND, "tcp")
    assert entry.distribution == "kvwire" and entry.builtin
    assert reg.resolve(Kind.BACKEND, "tcp") is TcpBackend


def test_broken_plugin_is_skipped_and_logged(
    fake_plugins: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        reg = PluginRegistry()
    assert [b.plugin for b in reg.broken] == ["brokenengine"]
    assert reg.broken[0].distribution == "fakeplug-broken"
    assert "libfake_engine.so" in reg.broken[0].error
    assert "brokenengine" in caplog.text and "fakeplug-broken" in caplog.text
    # other plugins still load
    assert "fakenative" in reg.names(Kind.BACKEND)


def test_selecting_broken_plugin_name_names_plugin_distribution_and_cause(
    fake_plugins: Path,
) -> None:
    reg = PluginRegistry()
    with pytest.raises(UnknownNameError) as exc:
        reg.get(Kind.BACKEND, "brokenengine")
    msg = str(exc.value)
    assert "brokenengine" in msg and "fakeplug-broken" in msg and "libfake_engine.so" in msg


def test_import_path_resolved_on_first_use_with_clear_error(fake_plugins: Path) -> None:
    reg = PluginRegistry()
    # Registration did not import the native module ...
    assert "fakeplug_native_engine" not in sys.modules
    # ... selecting it does, and the failure names plugin, distribution and cause.
    with pytest.raises(PluginError) as exc:
        reg.resolve(Kind.BACKEND, "fakenative")
    msg = str(exc.value)
    assert "'fakenative'" in msg and "good" in msg and "fakeplug-good" in msg
    assert "fakeplug_native_engine" in msg and "ModuleNotFoundError" in msg


def test_auto_skips_backends_that_do_not_import(fake_plugins: Path) -> None:
    reg = PluginRegistry()
    sel = select_backend(KVWireConfig(transfer_backend="auto"), registry=reg)
    # fakenative has the highest priority but fails to import: the next usable one wins
    usable = [
        e
        for e in reg.entries[Kind.BACKEND].values()
        if reg.try_resolve(Kind.BACKEND, e.name)[0] is not None
    ]
    assert sel.name != "fakenative"
    assert sel.name == max(usable, key=lambda e: e.impl.priority).name


def test_builtin_name_cannot_be_taken_over(fake_plugins: Path) -> None:
    reg = PluginRegistry()
    assert reg.resolve(Kind.BACKEND, "tcp") is TcpBackend
    assert any(c.name == "tcp" and "fakeplug-good" in c.refused for c in reg.conflicts)


def test_duplicate_third_party_names_are_refused(fake_plugins: Path) -> None:
    reg = PluginRegistry()
    with pytest.raises(PluginError, match="several plugins") as exc:
        reg.get(Kind.MAPPER, "dupmapper")
    assert "fakeplug-good" in str(exc.value) and "fakeplug-other" in str(exc.value)


def test_unknown_name_lists_available_and_install_hint() -> None:
    reg = PluginRegistry()
    with pytest.raises(UnknownNameError) as exc:
        reg.get(Kind.BACKEND, "rdmafoo")
    msg = str(exc.value)
    assert "Available: " in msg and "tcp" in msg.split("Available: ")[1]
    assert "pip install kvwire-rdmafoo" in msg


def test_kvwire_plugins_command_survives_broken_plugin(fake_plugins: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(fake_plugins), "COLUMNS": "200"}
    out = subprocess.run(
        [sys.executable, "-m", "kvwire.cli", "plugins"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "tcp" in out.stdout and "fakeplug-broken" in out.stdout
    assert "broken" in out.stdout and "fakenative" in out.stdout
    assert "failed" in out.stdout  # fakenative's import status


def test_kvwire_doctor_reports_backends() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvwire.cli", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    assert "tcp: write, read, notifications, dram" in out.stdout
    assert "tcp transport (core): ZeroMQ" in out.stdout
    assert "kvwire-nixl" in out.stdout or "NIXL" in out.stdout


def test_doctor_checks_from_builtins_and_failing_plugin_hooks(fake_plugins: Path) -> None:
    reg = PluginRegistry()
    checks = dict(reg.doctor_checks())
    assert checks["core"].ok and "ZeroMQ" in checks["core"].detail
    assert "tcp" in checks["core"].detail
    assert not checks["other"].ok and "engine probe crashed" in checks["other"].detail


def test_engine_benchmark_lookup(fake_plugins: Path) -> None:
    reg = PluginRegistry()
    # the built-in tcp backend registers none (it has `kvwire bench-backend`)
    assert reg.engine_benchmark("tcp") is None
    # a plugin's registration is imported on request; a broken one names itself
    assert reg.engine_benchmark("fakenative-bench") is not None
    with pytest.raises(PluginError, match="does not import"):
        reg.engine_benchmark("brokenbench")


# ------------------------------------------------------------------ plugin API versions
def test_plugin_api_compatibility_rules() -> None:
    from kvwire import plugin_api

    assert plugin_api.incompatibility(plugin_api.PLUGIN_API) is None
    assert plugin_api.incompatibility("2.0") is None and plugin_api.incompatibility("1.3") is None
    newer = plugin_api.incompatibility("2.7")
    assert newer is not None and "2.7" in newer and "upgrade kvwire" in newer
    future = plugin_api.incompatibility("3.0")
    assert future is not None and "3.0" in future and plugin_api.PLUGIN_API in future
    old = plugin_api.incompatibility("0.9")
    assert old is not None and "rebuild the plugin" in old
    bad = plugin_api.incompatibility("two")
    assert bad is not None and "MAJOR.MINOR" in bad
    assert plugin_api.is_legacy("1.0") and not plugin_api.is_legacy("2.0")
    # the hook specs and the backend contract carry the version a plugin declares
    from kvwire.backend import TransferBackend
    from kvwire.plugins import KVWireSpecs

    assert TransferBackend.CONTRACT_VERSION == KVWireSpecs.VERSION == plugin_api.PLUGIN_API


def test_a_future_plugin_is_refused_and_the_rest_keeps_working(make_dist: MakeDist) -> None:
    make_dist(
        "fakeplug-future",
        {"future": "fakeplug_future"},
        {"fakeplug_future": 'KVWIRE_PLUGIN_API = "5.1"\n'},
    )
    reg = get_registry()
    (broken,) = [b for b in reg.broken if b.plugin == "future"]
    assert "5.1" in broken.error and "upgrade kvwire" in broken.error
    assert reg.resolve(Kind.BACKEND, "tcp") is not None
