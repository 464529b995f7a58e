"""Options of the ``tcp`` backend (``--transfer-backend-option key=value``); the ``cudaipc``
plugin extends them for its side channel."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr

__all__ = ["TcpOptions"]


class TcpOptions(BaseModel):
    """Options of the ``tcp`` backend (``--transfer-backend-option key=value``)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(default="127.0.0.1", description="Interface the data socket binds to.")
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port.")
    advertise_host: str | None = Field(
        default=None, description="Address peers connect to (defaults to host)."
    )
    max_part_bytes: int = Field(
        default=16 << 20, ge=4096, description="Largest message of one transfer part."
    )
    transfer_timeout_s: float = Field(
        default=120.0, gt=0, description="A transfer not finished by then fails."
    )
    late_write_guard_s: float = Field(
        default=0.5,
        ge=0,
        description="How far apart the two hosts' wall clocks may be. A write part carries "
        "the wall-clock time by which it must land: its transfer's deadline less this guard. "
        "A target drops a part that arrives later (bytes held up by an outage), so no byte of "
        "a transfer lands after the initiator reported it FAILED, as long as the clocks agree "
        "within the guard (one host: always). At most half of transfer_timeout_s is used.",
    )
    send_hwm: int = Field(default=8, ge=1, description="Parts queued per peer socket.")
    local_notes: bool = Field(
        default=True,
        description="Notes (notifications alone: cudaipc's after its kernel; plain tcp sends "
        "none) to a peer on this host go over a UNIX datagram socket (a private directory: "
        "same user only) instead of ZeroMQ, one thread hop and the loopback stack shorter; a "
        "note that cannot be handed over at once still goes over ZeroMQ.",
    )
    secret: SecretStr | None = Field(
        default=None,
        description="Shared secret: the data plane then uses ZeroMQ CURVE with keys derived "
        "from it and refuses every connection that does not hold it. kvwire passes "
        "KVWIRE_SECRET here; never set it on a command line.",
    )

    @property
    def write_guard_s(self) -> float:
        """The guard applied: ``late_write_guard_s``, at most half the transfer timeout (a write
        part keeps at least half of it to land)."""
        return min(self.late_write_guard_s, self.transfer_timeout_s / 2)
