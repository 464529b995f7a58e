"""Options of the ``mooncake`` backend, validated once when an operator's
``--transfer-backend-option key=value`` pairs are read (the plugin's ``backend_options``
hook); read by :class:`~kvwire_mooncake.backend.MooncakeBackend` at construction."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvwire_mooncake.engine import ENGINE_MAX_QUEUE

__all__ = ["MooncakeOptions"]


class MooncakeOptions(BaseModel):
    """Options of the ``mooncake`` backend (``--transfer-backend-option key=value``)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(
        default="127.0.0.1",
        description="Address of this agent: the engine's segment name and the interface the "
        "notification socket binds to. The engine itself listens on all interfaces.",
    )
    advertise_host: str | None = Field(
        default=None, description="Address peers use (defaults to host; needed for 0.0.0.0)."
    )
    protocol: Literal["tcp", "rdma"] = Field(default="tcp", description="Engine transport.")
    device_name: str = Field(
        default="", description="RDMA devices, comma-separated (e.g. mlx5_0); empty: all."
    )
    rpc_port_range: tuple[int, int] | None = Field(
        default=None,
        description="Ports the engine's listeners (and the notification socket, unless "
        "notify_port is set) are taken from (MC_MIN_RPC_PORT/MC_MAX_RPC_PORT). Process-wide "
        "in Mooncake: it applies only if this agent is the first to import Mooncake, and "
        "must lie outside the kernel's ephemeral port range.",
    )
    notify_port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port.")
    connect_timeout_s: float = Field(
        default=10.0, gt=0, description="add_peer fails if the peer's engine does not answer."
    )
    max_batch_descs: int = Field(
        default=1024, ge=1, le=ENGINE_MAX_QUEUE, description="Descriptors per engine batch."
    )
    max_inflight_descs: int = Field(
        default=4096,
        ge=1,
        le=ENGINE_MAX_QUEUE,
        description="Descriptors handed to the engine per peer at a time (capped by the "
        "engine's per-peer queue, MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER).",
    )
    transfer_timeout_s: float = Field(
        default=120.0, gt=0, description="A transfer not finished by then fails."
    )
    completion_wait: Literal["adaptive", "spin"] = Field(
        default="adaptive",
        description="How the waiter thread waits for a batch: the engine's status call "
        "busy-polls a core; 'adaptive' sleeps through most of the expected transfer time "
        "first, 'spin' calls it at once (lowest latency, one core per active peer).",
    )
    log_level: Literal["INFO", "WARNING", "ERROR"] | None = Field(
        default=None,
        description="Engine log level (MC_LOG_LEVEL); default ERROR unless MC_LOG_LEVEL is set.",
    )

    @model_validator(mode="after")
    def _check(self) -> MooncakeOptions:
        if not self.host:
            raise ValueError("host must not be empty")
        if self.host in ("0.0.0.0", "::", "*") and not self.advertise_host:
            raise ValueError(
                f"host {self.host!r} is a wildcard: set advertise_host to the address peers use"
            )
        if self.rpc_port_range is not None:
            lo, hi = self.rpc_port_range
            if not 1024 <= lo <= hi <= 65535:
                raise ValueError(
                    f"rpc_port_range {self.rpc_port_range} must be (low, high) with "
                    "1024 <= low <= high <= 65535"
                )
        if self.max_batch_descs > self.max_inflight_descs:
            raise ValueError(
                f"max_batch_descs ({self.max_batch_descs}) must not exceed max_inflight_descs "
                f"({self.max_inflight_descs})"
            )
        return self
