"""The ``kv_transfer_params`` kvwire reads and writes, validated.

Params reach the connector from clients (through a router), so they are untrusted input: a
wrong type, a missing key or an address without a port must fail *that request* with a
message naming the field, never raise inside vLLM's scheduler (which would take the engine
down). Every read of params in the connector goes through :func:`read_decode_params` or
:func:`read_prefill_request`, which never raise.

Keys (prefill's ``request_finished`` -> router -> decode's request):

* ``do_remote_prefill`` (bool): decode loads this request's KV from prefill.
* ``kvwire_room`` (int, ``[0, 2**63)``): the request's room on prefill.
* ``kvwire_bootstrap_addr`` (``host:port``; IPv6 hosts in brackets, ``[::1]:8998``).
* ``remote_num_tokens`` (int >= 1): the prompt tokens prefill computed.
* ``kvwire_block_size`` (int, optional): prefill's vLLM block size (informational).
* ``kvwire_prompt_hash`` (16 hex digits): :func:`prompt_hash` of the prompt prefill
  computed; decode refuses the KV when its own request's prompt hashes differently (a router
  that paired the wrong prompts would otherwise get silently wrong output).

The router's request to prefill carries ``do_remote_decode`` (bool). Keys of other
connectors or routers are ignored; a ``kvwire_*`` key this version does not know is refused
(a newer prefill's params carry something this decode would silently drop).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

#: kv_transfer_params keys (prefill's request_finished -> router -> decode's request).
ROOM = "kvwire_room"
BOOTSTRAP = "kvwire_bootstrap_addr"
NUM_TOKENS = "remote_num_tokens"
BLOCK_SIZE = "kvwire_block_size"
PROMPT_HASH = "kvwire_prompt_hash"
#: The router's request to prefill, and what prefill returns for decode (vLLM's own keys).
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"

#: Every ``kvwire_*`` key this version reads or writes.
KVWIRE_KEYS = frozenset({ROOM, BOOTSTRAP, BLOCK_SIZE, PROMPT_HASH})
_PREFIX = "kvwire_"

#: Largest prompt length accepted (vLLM's max_model_len is far below).
MAX_TOKENS = 2**31 - 1
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
    r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$"
)


def check_host_port(value: str) -> str:
    """``value`` if it is ``host:port`` (hostname, IPv4, or bracketed IPv6 with a port in
    1..65535), else :class:`ValueError` saying what is wrong."""
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError(f"{value!r}: '[' without ']' (IPv6 form is [::1]:8998)")
        host, rest = value[1:end], value[end + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{value!r}: {host!r} in brackets is not an IPv6 address") from None
        if not rest.startswith(":"):
            raise ValueError(f"{value!r} has no port (expected [host]:port)")
        port = rest[1:]
    else:
        host, sep, port = value.rpartition(":")
        if not sep:
            raise ValueError(f"{value!r} has no port (expected host:port)")
        if ":" in host:
            raise ValueError(f"{value!r}: write an IPv6 host in brackets, e.g. [::1]:8998")
        if not host:
            raise ValueError(f"{value!r} has no host (expected host:port)")
        if not _HOSTNAME.match(host):
            raise ValueError(f"{value!r}: {host!r} is not a hostname or IPv4 address")
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r}: port {port!r} is not a number in 1..65535")
    return value


#: A validated ``host:port`` string.
HostPort = Annotated[str, Field(min_length=3, max_length=300), AfterValidator(check_host_port)]


class _Params(BaseModel):
    """Strict types (no "1" for 1, no 1.0 for 1); other connectors' keys ignored; an unknown
    ``kvwire_*`` key refused."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _known_kvwire_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            unknown = sorted(
                str(k)
                for k in data
                if isinstance(k, str) and k.startswith(_PREFIX) and k not in KVWIRE_KEYS
            )
            if unknown:
                raise ValueError(
                    f"unknown kvwire key(s) {', '.join(unknown)} (this kvwire-vllm reads "
                    f"{', '.join(sorted(KVWIRE_KEYS))}; is prefill running a newer version?)"
                )
        return data


class PrefillRequest(_Params):
    """The router's params for prefill's leg of a request."""

    do_remote_decode: bool = False


class RemotePrefill(_Params):
    """Prefill's params for decode's leg: where and what to load."""

    do_remote_prefill: bool
    do_remote_decode: bool = False
    kvwire_room: int = Field(ge=0, lt=2**63)
    kvwire_bootstrap_addr: HostPort
    remote_num_tokens: int = Field(ge=1, le=MAX_TOKENS)
    kvwire_block_size: int | None = Field(default=None, ge=1, le=1 << 20)
    kvwire_prompt_hash: str = Field(pattern=r"^[0-9a-f]{16}$")

    @property
    def target(self) -> tuple[int, str]:
        """``(room, bootstrap address)``."""
        return self.kvwire_room, self.kvwire_bootstrap_addr


class _Target(BaseModel):
    """The room and address alone (to release prefill's blocks when the rest is bad)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    kvwire_room: int = Field(ge=0, lt=2**63)
    kvwire_bootstrap_addr: HostPort


@dataclass(frozen=True)
class Refusal:
    """A kvwire request whose params cannot be used: ``reason`` names the field. ``target``
    is ``(room, bootstrap address)`` when those two are valid, so decode can still tell
    prefill (which holds the request's blocks for it) to free them."""

    reason: str
    target: tuple[int, str] | None = None


def prompt_hash(token_ids: Sequence[int] | None) -> str:
    """Short identity of a prompt: BLAKE2b (8 bytes, hex) of its token ids as int64.
    Computed by prefill when the request finishes, and by decode for its own request."""
    data = np.asarray(token_ids if token_ids is not None else [], dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def describe(exc: ValidationError) -> str:
    """One line per bad field: ``field: what is wrong (got value)``."""
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err.get("loc", ())) or "params"
        got = repr(err.get("input"))
        if len(got) > 60:
            got = got[:57] + "..."
        what = str(err.get("msg", "invalid"))
        shown = where != "params" and err.get("type") != "missing"
        parts.append(f"{where}: {what}" + (f" (got {got})" if shown else ""))
    return "; ".join(parts)


def _kvwire_keys(raw: Mapping[Any, Any]) -> bool:
    return any(isinstance(k, str) and k.startswith(_PREFIX) for k in raw)


def _target(raw: object) -> tuple[int, str] | None:
    try:
        t = _Target.model_validate(raw)
    except Exception:
        return None
    return t.kvwire_room, t.kvwire_bootstrap_addr


def read_decode_params(raw: object) -> RemotePrefill | Refusal | None:
    """Decode's scheduler: what a request's ``kv_transfer_params`` ask of kvwire.

    None: not a pending kvwire load (no params, no ``kvwire_*`` key — another connector's
    params — or ``do_remote_prefill`` false or absent). :class:`RemotePrefill`: valid.
    :class:`Refusal`: a kvwire load whose params are malformed. Never raises.
    """
    try:
        if not isinstance(raw, Mapping) or not _kvwire_keys(raw):
            return None
        flag = raw.get(DO_REMOTE_PREFILL)
        if flag is None or flag is False:
            return None
        return RemotePrefill.model_validate(raw)
    except ValidationError as exc:
        return Refusal(f"invalid kv_transfer_params: {describe(exc)}", _target(raw))
    except Exception as exc:  # a hostile Mapping whose methods raise
        return Refusal(f"invalid kv_transfer_params: {type(exc).__name__}: {exc}")


def read_prefill_request(raw: object) -> PrefillRequest | Refusal | None:
    """Prefill's scheduler: whether a request asks for its KV to be pushed to decode.

    None: no params, or nothing for kvwire in them. Never raises.
    """
    try:
        if not isinstance(raw, Mapping):
            return None
        if DO_REMOTE_DECODE not in raw and not _kvwire_keys(raw):
            return None
        return PrefillRequest.model_validate(raw)
    except ValidationError as exc:
        return Refusal(f"invalid kv_transfer_params: {describe(exc)}")
    except Exception as exc:
        return Refusal(f"invalid kv_transfer_params: {type(exc).__name__}: {exc}")
