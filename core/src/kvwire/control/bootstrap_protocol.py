"""What the bootstrap service's client (:mod:`kvwire.control.bootstrap`) and server
(:mod:`kvwire.control.bootstrap_server`) agree on: a rank's entry (:class:`RankInfo`), the
authentication headers and their signature, and the limits the server enforces. The HTTP API
itself is described in :mod:`kvwire.control.bootstrap`.
"""

from __future__ import annotations

import hashlib
import hmac

import pydantic

#: Header carrying the request's Unix time (seconds, decimal) when a secret is configured.
TIMESTAMP_HEADER = "X-KVWire-Timestamp"
#: Header carrying a random nonce, new for every signed request (replay protection).
NONCE_HEADER = "X-KVWire-Nonce"
#: Header carrying the hex HMAC-SHA256 signature of the request.
SIGNATURE_HEADER = "X-KVWire-Signature"
#: Requests whose timestamp is further than this from the server's clock are refused.
MAX_CLOCK_SKEW_S = 300.0
#: Largest request body the server accepts.
MAX_BODY_BYTES = 64 * 1024

RankKey = tuple[int, int, int]  # (dp_rank, tp_rank, pp_rank)


class RankInfo(pydantic.BaseModel):
    """How to reach one prefill rank: published by that rank, read by decode ranks."""

    model_config = pydantic.ConfigDict(extra="ignore", frozen=True)

    tp_rank: int = pydantic.Field(ge=0)
    pp_rank: int = pydantic.Field(default=0, ge=0)
    dp_rank: int = pydantic.Field(default=0, ge=0)
    tp_size: int = pydantic.Field(ge=1)
    pp_size: int = pydantic.Field(default=1, ge=1)
    dp_size: int = pydantic.Field(default=1, ge=1)
    #: The rank's control-plane ZeroMQ endpoint, e.g. ``"tcp://127.0.0.1:5555"``.
    endpoint: str = pydantic.Field(min_length=1)
    #: The rank's transfer-agent name.
    agent: str = pydantic.Field(min_length=1)
    #: Random id of this process incarnation; a restarted rank has a new one.
    session: str = pydantic.Field(min_length=1)
    protocol: int = 1
    #: What the rank announces for ``kvwire doctor --peer`` (read-only; absent from ranks
    #: and services older than protocol 1.8, whose entries read as None and empty here):
    #: its control protocol's minor version,
    protocol_minor: int | None = None
    #: its transfer backends in preference order (the order its links follow),
    backends: list[str] = pydantic.Field(default_factory=list)
    #: whether ``--transfer-backend auto`` chose them (the per-link rule then picks),
    backend_auto: bool = False
    #: and its host identity (``{"boot_id", "hostname"}``).
    host: dict[str, str] = pydantic.Field(default_factory=dict)

    @pydantic.model_validator(mode="after")
    def _ranks_in_range(self) -> RankInfo:
        for name in ("tp", "pp", "dp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if rank >= size:
                raise ValueError(f"{name}_rank={rank} is out of range for {name}_size={size}")
        return self

    @property
    def key(self) -> RankKey:
        """``(dp_rank, tp_rank, pp_rank)``: identifies the rank across incarnations."""
        return (self.dp_rank, self.tp_rank, self.pp_rank)

    def describe(self) -> str:
        """Short human-readable name of the rank, for logs and error messages."""
        return f"dp={self.dp_rank} tp={self.tp_rank} pp={self.pp_rank}"


def sign_request(
    secret: bytes, method: str, path_qs: str, timestamp: str, body: bytes, nonce: str = ""
) -> str:
    """Hex HMAC-SHA256 of a request; used by the client to sign and the server to verify."""
    parts = [method.upper().encode(), path_qs.encode(), timestamp.encode(), nonce.encode(), body]
    msg = b"\n".join(parts)
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
