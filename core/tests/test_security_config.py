"""Operator-facing security settings (issue 14): ``require_secret`` refuses to start without a
secret, a non-loopback endpoint without a secret logs one WARNING, and ``kvwire doctor`` says
so."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest
from pydantic import SecretStr
from rich.console import Console

from kvwire.cli import _doctor_security, main
from kvwire.config import ControlOptions, KVWireConfig
from kvwire.control.bootstrap_server import BootstrapServer
from kvwire.control.channel import ControlChannel
from kvwire.control.wire import Codec
from kvwire.errors import ConfigError
from kvwire.layout import RankPosition
from kvwire.security import exposure_checks, is_loopback, reset_exposure_warnings
from kvwire.session import KVManager, Role
from kvwire.testing.kvfill import make_pool
from kvwire.testing.pair import MODEL


@pytest.fixture(autouse=True)
def fresh_warnings() -> Iterator[None]:
    reset_exposure_warnings()
    yield
    reset_exposure_warnings()


def manager(config: KVWireConfig) -> KVManager:
    layout, _ = make_pool(MODEL, RankPosition(), 4)
    return KVManager(config, Role.DECODE, layout)


# ------------------------------------------------------------------------- require_secret
@pytest.mark.parametrize("secret", [None, ""], ids=["unset", "empty"])
def test_require_secret_refuses_to_start(secret: str | None) -> None:
    cfg = KVWireConfig(
        transfer_backend="tcp",
        require_secret=True,
        secret=SecretStr(secret) if secret is not None else None,
    )
    with pytest.raises(ConfigError, match="require_secret") as e:
        manager(cfg)
    assert "KVWIRE_SECRET" in str(e.value) and "KVWIRE_REQUIRE_SECRET" in str(e.value)


def test_require_secret_from_env_and_satisfied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWIRE_REQUIRE_SECRET", "1")
    monkeypatch.setenv("KVWIRE_TRANSFER_BACKEND", "tcp")
    with pytest.raises(ConfigError, match="require_secret"):
        manager(KVWireConfig())
    monkeypatch.setenv("KVWIRE_SECRET", "s3cret")
    mgr = manager(KVWireConfig())
    try:
        assert mgr.codec.authenticated
        assert mgr.backend.auth is not None  # type: ignore[attr-defined]  # tcp got the secret
    finally:
        mgr.close()


def test_bootstrap_command_honours_require_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWIRE_REQUIRE_SECRET", "true")
    monkeypatch.delenv("KVWIRE_SECRET", raising=False)
    assert main(["bootstrap", "--port", "0"]) == 1


# ---------------------------------------------------------------------------- warnings
def test_open_control_endpoint_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    chans = []
    with caplog.at_level(logging.WARNING, logger="kvwire.security"):
        chans.append(ControlChannel(Codec(), "127.0.0.1"))
        chans.append(ControlChannel(Codec(b"k"), "0.0.0.0"))
        assert "control endpoint" not in caplog.text
        chans.append(ControlChannel(Codec(), "0.0.0.0"))
        chans.append(ControlChannel(Codec(), "0.0.0.0"))
    for c in chans:
        c.close()
    hits = [r for r in caplog.records if "control endpoint" in r.getMessage()]
    assert len(hits) == 1 and hits[0].levelno == logging.WARNING
    assert "0.0.0.0" in hits[0].getMessage() and "KVWIRE_SECRET" in hits[0].getMessage()


def test_open_bootstrap_service_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvwire.security"):
        with BootstrapServer("0.0.0.0", 0, b"k"):
            pass
        assert "bootstrap service" not in caplog.text
        with BootstrapServer("0.0.0.0", 0, None):
            pass
    assert "bootstrap service listens on 0.0.0.0 without a shared secret" in caplog.text


def test_manager_on_open_address_warns(caplog: pytest.LogCaptureFixture) -> None:
    """A whole rank bound to a non-loopback address without a secret: control endpoint and
    tcp data endpoint both warn."""
    cfg = KVWireConfig(
        transfer_backend="tcp",
        transfer_backend_options={"host": "0.0.0.0"},
        control=ControlOptions(host="0.0.0.0"),
    )
    with caplog.at_level(logging.WARNING, logger="kvwire.security"):
        manager(cfg).close()
    text = caplog.text
    assert "control endpoint listens on 0.0.0.0" in text
    assert "tcp data endpoint listens on 0.0.0.0" in text


# ------------------------------------------------------------------------------- doctor
def test_loopback_detection() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "localhost", "::1", "[::1]", "127.3.2.1"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.2", "*", "node7"]))


def test_doctor_flags_open_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVWIRE_SECRET", raising=False)
    monkeypatch.setenv("KVWIRE_CONTROL__HOST", "10.1.2.3")
    out = io.StringIO()
    advice = _doctor_security(Console(file=out, width=200))
    assert "control endpoint (control.host): listens on 10.1.2.3 without a secret" in out.getvalue()
    assert any("KVWIRE_SECRET" in a for a in advice)
    monkeypatch.setenv("KVWIRE_SECRET", "s3cret")
    assert _doctor_security(Console(file=io.StringIO())) == []


def test_exposure_checks_with_require_secret() -> None:
    checks = exposure_checks(KVWireConfig(require_secret=True))
    assert not checks[0].ok and "refuse to start" in checks[0].detail
    assert all(c.ok for c in checks[1:])  # loopback defaults
