"""Wire schema: stored fixtures of every released protocol version still parse; version,
authentication and malformed-input rules."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import msgpack
import pytest

from kvwire.control.wire import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    RETIRED_KINDS,
    Codec,
    Failure,
    Heartbeat,
    Hello,
    TransferRequest,
    pages_from_bytes,
)
from kvwire.errors import ProtocolError

FIXTURES = Path(__file__).parent / "fixtures" / "wire"
SECRET = b"fixture-secret"
VERSIONS = sorted(
    (p for p in FIXTURES.iterdir() if p.is_dir()),
    key=lambda p: tuple(int(x) for x in p.name[1:].split(".")),
)


def test_fixture_versions_exist() -> None:
    assert [v.name for v in VERSIONS] == [
        "v1.0",
        "v1.1",
        "v1.2",
        "v1.3",
        "v1.4",
        "v1.5",
        "v1.6",
        "v1.7",
        "v1.8",
        "v1.9",
        "v1.10",
        "v1.11",
        "v1.12",
        "v1.13",
        "v1.14",
    ]


def test_pools_announced_old_and_new() -> None:
    """A 1.9 hello's host pool reads as the extra pool ``"host"``; a 1.10 hello names any
    number of pools, and still fills the 1.9 fields for its ``"host"`` pool."""
    plain = Codec()
    old = plain.decode((FIXTURES / "v1.9" / "hello.bin").read_bytes())
    assert isinstance(old, Hello) and old.pools == {}
    assert old.host_layout is not None
    assert old.extra_pools() == {"host": (old.host_layout, old.host_staging)}
    new = plain.decode((FIXTURES / "v1.10" / "hello.bin").read_bytes())
    assert isinstance(new, Hello)
    extra = new.extra_pools()
    assert sorted(extra) == ["host", "ssd"]
    assert extra["ssd"] == (new.layout, None)
    assert extra["host"][1] == new.host_staging and new.host_layout == new.layout


def test_pool_names_are_strings_checked_for_shape() -> None:
    """Any pool name is carried (the receiver checks it against the announced ones); an
    empty or malformed one is refused at decode, naming the field."""
    body = {"room": 5, "session": "s", "dst_pages": b"", "pool": "ssd"}
    msg = Codec().decode(_frame("transfer_request", body))
    assert isinstance(msg, TransferRequest) and msg.pool == "ssd"
    for bad in ("", "a b", "x" * 65):
        with pytest.raises(ProtocolError, match="pool"):
            Codec().decode(_frame("transfer_request", {**body, "pool": bad}))
    hello = msgpack.unpackb(msgpack.unpackb((FIXTURES / "v1.10" / "hello.bin").read_bytes())[3])
    hello["pools"] = {"kv": hello["layout"]}
    with pytest.raises(ProtocolError, match="kv"):
        Codec().decode(_frame("hello", hello))


def test_hello_offers_old_and_new() -> None:
    """A 1.7 hello (one backend, no ``backends``) reads as one offer; a 1.8 hello lists every
    backend, and still carries its first in ``backend``/``backend_metadata`` for 1.7 prefills."""
    plain = Codec()
    old = plain.decode((FIXTURES / "v1.7" / "hello.bin").read_bytes())
    assert isinstance(old, Hello)
    assert old.offers() == [(old.backend, old.backend_metadata)] and old.host == {}
    new = plain.decode((FIXTURES / "v1.8" / "hello.bin").read_bytes())
    assert isinstance(new, Hello)
    assert [n for n, _ in new.offers()] == ["tcp", "nixl"]
    assert (new.backend, new.backend_metadata) == new.offers()[0]
    assert new.host["hostname"] == "decode-host"


@pytest.mark.parametrize("folder", VERSIONS, ids=lambda p: p.name)
def test_released_versions_still_parse(folder: Path) -> None:
    expected = json.loads((folder / "expected.json").read_text())
    plain, signed = Codec(), Codec(SECRET)
    for kind, fields in expected.items():
        for codec, name in ((plain, f"{kind}.bin"), (signed, f"{kind}.signed.bin")):
            if kind in RETIRED_KINDS:  # refused, saying so: never misread
                with pytest.raises(ProtocolError, match=f"{kind}' was retired in protocol"):
                    codec.decode((folder / name).read_bytes())
                continue
            msg = codec.decode((folder / name).read_bytes())
            assert msg.kind == kind
            dumped = msg.model_dump(mode="json")
            for field, value in fields.items():
                assert dumped[field] == value, (name, field)
            for field in set(dumped) - set(fields):  # added since: the defaults
                default = type(msg).model_fields[field].get_default(call_default_factory=True)
                assert dumped[field] == default, (name, field)


def _frame(kind: str, body: dict, major: int = PROTOCOL_MAJOR, minor: int = 0) -> bytes:
    return msgpack.packb([major, minor, kind, msgpack.packb(body), b""])


def test_newer_minor_with_unknown_fields_is_accepted() -> None:
    folder = FIXTURES / "v1.0"
    outer = msgpack.unpackb((folder / "hello.bin").read_bytes())
    body = msgpack.unpackb(outer[3])
    body["future_field"] = {"x": 1}
    body["layout"]["future_layout_field"] = 3
    body["layout"]["model"]["future_model_field"] = "y"
    body["layout"]["buffers"][0]["future_region_field"] = 1
    body["rank"]["future_rank_field"] = 0
    msg = Codec().decode(_frame("hello", body, minor=99))
    assert isinstance(msg, Hello)
    assert msg.layout.model.page_size == 4
    assert not hasattr(msg, "future_field")


def test_older_peer_without_optional_fields_gets_defaults() -> None:
    msg = Codec().decode(_frame("transfer_request", {"room": 5, "session": "s", "dst_pages": b""}))
    assert isinstance(msg, TransferRequest)
    assert msg.aux_index == -1 and msg.state_indices is None and msg.staging is None
    assert pages_from_bytes(msg.dst_pages).size == 0


def test_other_major_version_is_refused_naming_both() -> None:
    with pytest.raises(ProtocolError, match=rf"protocol 2\.0.*speaks 1\.{PROTOCOL_MINOR}"):
        Codec().decode(_frame("heartbeat", {"session": "s"}, major=2))


def test_authentication() -> None:
    folder = FIXTURES / "v1.0"
    signed = (folder / "failure.signed.bin").read_bytes()
    plain = (folder / "failure.bin").read_bytes()
    with pytest.raises(ProtocolError, match="failed authentication"):
        Codec(b"another-secret").decode(signed)
    with pytest.raises(ProtocolError, match="unauthenticated"):
        Codec(SECRET).decode(plain)
    outer = msgpack.unpackb(signed)
    body = msgpack.unpackb(outer[3])
    body["reason"] = "forged"
    outer[3] = msgpack.packb(body)
    with pytest.raises(ProtocolError, match="failed authentication"):
        Codec(SECRET).decode(msgpack.packb(outer))
    # a receiver without a secret still reads signed frames (the MAC is just not checked)
    assert isinstance(Codec().decode(signed), Failure)


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (b"\xc1garbage", "not a kvwire frame"),
        (msgpack.packb({"a": 1}), "expected \\[major"),
        (msgpack.packb([1, 0, "heartbeat"]), "expected \\[major"),
        (msgpack.packb(["1", 0, "heartbeat", b"", b""]), "header"),
        (msgpack.packb([1, 0, "heartbeat", "str-body", b""]), "must be bytes"),
        (_frame("no_such_kind", {}), "unknown message kind"),
        (_frame("heartbeat", {}), "malformed 'heartbeat'"),
        (_frame("failure", {"room": -1, "session": "s", "reason": "r"}), "malformed 'failure'"),
        (msgpack.packb([1, 0, "heartbeat", b"\xc1", b""]), "malformed 'heartbeat' body"),
        (pickle.dumps(Heartbeat(session="s")), "not a kvwire frame"),
    ],
)
def test_malformed_frames_are_refused(frame: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        Codec().decode(frame)


def test_page_bytes_must_be_whole_int64() -> None:
    with pytest.raises(ProtocolError, match="whole number"):
        pages_from_bytes(b"\x00" * 7)
