"""Config models, argparse helpers, environment, and selection-time validation."""

from __future__ import annotations

import argparse

import pytest

from kvwire.backends.tcp import TcpBackend, TcpOptions
from kvwire.config import KVWireConfig, add_cli_args, config_from_args
from kvwire.errors import CapabilityError, ConfigError, PluginError
from kvwire.layout import MemKind
from kvwire.selection import create_backend, select_backend, select_staging, staging_candidates


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p.parse_args(argv)


def test_cli_args_build_config() -> None:
    ns = parse(
        [
            "--transfer-backend",
            "tcp",
            "--transfer-backend-option",
            "port=0",
            "--transfer-backend-option",
            "host=127.0.0.1",
            "--staging",
            "direct",
        ]
    )
    cfg = config_from_args(ns, use_env=False)
    assert cfg.transfer_backend == "tcp"
    assert cfg.transfer_backend_options == {"port": 0, "host": "127.0.0.1"}
    sel = select_backend(cfg)
    assert sel.cls is TcpBackend and isinstance(sel.options, TcpOptions)


def test_env_fills_unset_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWIRE_TRANSFER_BACKEND", "tcp")
    monkeypatch.setenv("KVWIRE_TRANSFER_BACKEND_OPTIONS", '{"max_part_bytes": 65536}')
    cfg = config_from_args(parse([]))
    assert cfg.transfer_backend == "tcp"
    assert cfg.transfer_backend_options == {"max_part_bytes": 65536}
    # explicit arguments win over the environment
    assert config_from_args(parse(["--transfer-backend", "auto"])).transfer_backend == "auto"


def test_unknown_config_field_refused() -> None:
    with pytest.raises(ValueError, match="transfer_backnd"):
        KVWireConfig(transfer_backnd="tcp")  # type: ignore[call-arg]


def test_malformed_option_item() -> None:
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        config_from_args(parse(["--transfer-backend-option", "novalue"]), use_env=False)


def test_backend_options_validated_at_selection() -> None:
    cfg = KVWireConfig(transfer_backend="tcp", transfer_backend_options={"prot": 1})
    with pytest.raises(ConfigError) as exc:
        select_backend(cfg)
    assert "prot" in str(exc.value) and "Accepted options" in str(exc.value)
    assert "port" in str(exc.value)
    cfg = KVWireConfig(transfer_backend="tcp", transfer_backend_options={"port": 70000})
    with pytest.raises(ConfigError, match="port"):
        select_backend(cfg)


def test_capabilities_checked_at_selection() -> None:
    with pytest.raises(CapabilityError, match="VRAM memory"):
        select_backend(KVWireConfig(transfer_backend="tcp"), kinds=[MemKind.VRAM])


def test_create_backend_and_staging() -> None:
    be = create_backend(KVWireConfig(transfer_backend="tcp"), "agent-x")
    try:
        assert isinstance(be, TcpBackend) and be.endpoint.startswith("tcp://127.0.0.1:")
    finally:
        be.close()
    assert select_staging(KVWireConfig()).name == "direct"  # auto, host pool


def test_auto_staging_is_bulk_on_gpu_pools_then_direct() -> None:
    """``--staging auto`` (the default): bulk staging for a KV pool in GPU memory, with
    ``direct`` behind it (tried when bulk cannot set up); host and mixed pools get
    ``direct``; a named strategy is the one candidate; options go to the candidates that
    have them."""
    vram, dram = [MemKind.VRAM], [MemKind.DRAM]
    auto = KVWireConfig(staging_options={"ring_bytes": 1 << 27, "block_bytes": 1 << 16})
    names = [s.name for s in staging_candidates(auto, vram)]
    assert names == ["bulk", "direct"]
    bulk = staging_candidates(auto, vram)[0]
    assert bulk.options.ring_bytes == 1 << 27  # type: ignore[attr-defined]
    assert [s.name for s in staging_candidates(auto, dram)] == ["direct"]
    assert [s.name for s in staging_candidates(auto, [*vram, *dram])] == ["direct"]
    assert select_staging(auto, kinds=vram).name == "bulk"
    named = KVWireConfig(staging="direct")
    assert [s.name for s in staging_candidates(named, vram)] == ["direct"]
    with pytest.raises(PluginError):
        staging_candidates(KVWireConfig(staging="nope"), vram)
