"""Configuration: pydantic models, ``--transfer-backend`` style CLI arguments, environment.

Engines use argparse, so :func:`add_cli_args` adds kvwire's options to the engine's parser and
:func:`config_from_args` builds a :class:`KVWireConfig` from the parsed namespace, falling back
to ``KVWIRE_*`` environment variables (read by pydantic-settings) for anything not given.
Implementation options (``--transfer-backend-option key=value``) are validated against the
selected implementation's own options model at selection (:mod:`kvwire.selection`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvwire.errors import ConfigError

AUTO = "auto"


class ControlOptions(BaseModel):
    """Control-plane settings: addresses, threads, deadlines and heartbeats.

    Environment: ``KVWIRE_CONTROL__HEARTBEAT_INTERVAL_S=0.5`` and so on; CLI:
    ``--control-option heartbeat_interval_s=0.5``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(
        default="127.0.0.1",
        description="Address this rank's control endpoint binds to and advertises.",
    )
    bootstrap_host: str = Field(
        default="127.0.0.1", description="Address the in-process bootstrap service binds to."
    )
    bootstrap_port: int = Field(
        default=0, ge=0, lt=65536, description="Bootstrap port (0 picks a free one)."
    )
    run_bootstrap: bool = Field(
        default=True, description="Prefill rank 0 runs the bootstrap service in-process."
    )
    num_workers: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="Transfer worker threads of a prefill rank. None: the transfer backend's "
        "own number (TransferBackend.suggested_workers: 1 for cudaipc, whose writes are GPU "
        "launches that return at once, so more workers only take turns on the GIL), else 4.",
    )
    max_inflight_chunks: int = Field(
        default=16, ge=1, le=4096, description="Transfers a worker keeps posted at once."
    )
    max_queued_chunks: int = Field(
        default=4096,
        ge=1,
        description="Prefill: chunks queued for the workers at which KVManager.saturated turns "
        "True (backpressure the engine can check before admitting requests; nothing is refused "
        "or timed out for it).",
    )
    kv_checksum: bool = Field(
        default=False,
        description="Decode asks every prefill rank for a checksum of each KV chunk it sends "
        "and checks the bytes that landed before reporting success (docs/integrity.md). KV "
        "pools in host or GPU memory (GPU sums need torch and triton); set on decode (prefill "
        "answers what decode asks).",
    )
    layerwise_groups: int = Field(
        default=4,
        ge=1,
        le=16,
        description="Layer-wise chunks (send(..., layerwise=True)): the rank's layers are "
        "posted in this many groups as they are computed (one transfer and note each).",
    )
    failover_probe_s: float = Field(
        default=0.5,
        gt=0,
        description="Several backends (--transfer-backend nixl,tcp): first wait before a "
        "backend that failed a link is reconnected in the background; doubled after each "
        "failed probe, up to 30 s (docs/failover.md).",
    )
    sync_transfers: bool = Field(
        default=False,
        description="Transfer on the caller's thread inside send() (benchmark baseline).",
    )
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    heartbeat_misses: int = Field(default=3, ge=1, description="Missed beats before eviction.")
    bootstrap_timeout_s: float = Field(
        default=30.0, gt=0, description="Prefill: decode metadata must arrive within this."
    )
    waiting_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Decode: a request fails when neither it nor any other request from its "
        "prefill ranks advanced for this long.",
    )
    handshake_timeout_s: float = Field(default=10.0, gt=0)
    transfer_timeout_s: float = Field(default=60.0, gt=0, description="One chunk's transfer.")
    send_hwm: int = Field(default=1000, ge=1, description="Queued control frames per peer.")
    local_control: bool = Field(
        default=True,
        description="Control frames to a peer in this host's network namespace go over a UNIX "
        "socket instead of ZeroMQ over loopback TCP, once the handshake found it reachable "
        "(fewer threads on a request's path; the same frames, checks and order). Off: "
        "ZeroMQ only (docs/control-plane.md).",
    )
    timer_slack_us: float | None = Field(
        default=1.0,
        gt=0,
        le=1_000_000,
        description="Timer slack kvwire's own threads ask Linux for (prctl PR_SET_TIMERSLACK, "
        "per thread; the engine's threads keep theirs) on a rank whose backend is polled "
        "(NIXL, Mooncake, a backend list): their short waits on a request's path (a worker's "
        "20-200 us polls of a write, decode's 0.2 ms progress tick) otherwise end up to the "
        "default 50 us late. Backends that push events (cudaipc, tcp) keep the default. "
        "None: leave the default everywhere (kvwire.timer_slack).",
    )
    aux_slots: int = Field(
        default=4096, ge=1, description="Aux rows when the engine passes no aux buffers."
    )
    metrics_port: int | None = Field(
        default=None, description="Serve Prometheus metrics on this port (None: do not serve)."
    )
    gil_switch: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Lower the Python interpreter's GIL switch interval (process-wide, 5 ms by "
        "default) to gil_switch_interval_us: 'auto' once kvwire's threads are seen waiting "
        "a millisecond or more to run (an engine thread that runs Python), 'always' when the "
        "manager starts, 'never' (kvwire.gil, docs/control-plane.md).",
    )
    gil_switch_interval_us: float = Field(
        default=100.0,
        gt=0,
        le=100_000,
        description="The switch interval gil_switch sets, in microseconds (a shorter one the "
        "engine chose is kept).",
    )


class PoolConfig(BaseModel):
    """How one named extra pool is served (``KVWireConfig.pools[name]``): the mapper from a
    prefill rank's KV into it, and the staging strategy of chunks into it. 'auto' takes the
    highest-priority installed implementation that declares the pool (``pools=(name,)``);
    staging falls back to 'direct' when none does."""

    model_config = ConfigDict(extra="forbid")

    mapper: str = Field(default=AUTO, description="Mapper name, or 'auto'.")
    mapper_options: dict[str, Any] = Field(default_factory=dict)
    staging: str = Field(default=AUTO, description="Staging strategy name, or 'auto'.")
    staging_options: dict[str, Any] = Field(default_factory=dict)


class KVWireConfig(BaseSettings):
    """Which implementations to use, and their options.

    Environment: ``KVWIRE_TRANSFER_BACKEND=nixl``,
    ``KVWIRE_TRANSFER_BACKEND_OPTIONS='{"host": "10.0.0.2"}'`` (JSON), and so on.
    """

    model_config = SettingsConfigDict(
        env_prefix="KVWIRE_", env_nested_delimiter="__", extra="forbid"
    )

    transfer_backend: str = Field(
        default=AUTO,
        description="'auto', a backend name, or a comma-separated list in preference order "
        "('nixl,tcp'): each link uses the first backend both sides have that can serve it, "
        "and fails over to the next (docs/failover.md).",
    )
    transfer_backend_options: dict[str, Any] = Field(default_factory=dict)
    index_mapper: str = Field(default=AUTO, description="Mapper name, or 'auto' per layout.")
    index_mapper_options: dict[str, Any] = Field(default_factory=dict)
    staging: str = Field(
        default=AUTO,
        description="Staging strategy of the KV pool: 'auto' (bulk staging where the pool is "
        "in GPU memory and it can set up there, else 'direct'; docs/staging.md), or a "
        "strategy name ('direct', 'bulk', a plugin's).",
    )
    staging_options: dict[str, Any] = Field(default_factory=dict)
    pools: dict[str, PoolConfig] = Field(
        default_factory=dict,
        description="Per extra pool (a pool an engine declares besides 'kv', e.g. a decode "
        "host pool): its mapper and staging strategy. A pool not named here uses 'auto' for "
        "both (the installed plugin that declares the pool). Environment: "
        'KVWIRE_POOLS=\'{"<pool>": {"staging": "direct"}}\'.',
    )
    control: ControlOptions = Field(default_factory=ControlOptions)
    secret: SecretStr | None = Field(
        default=None,
        description="Shared secret: control messages carry an HMAC-SHA256 and the bootstrap "
        "service requires it. Set through KVWIRE_SECRET, never on a command line.",
    )
    require_secret: bool = Field(
        default=False,
        description="Refuse to start without a shared secret (KVWIRE_REQUIRE_SECRET=1): a "
        "deployment that must not run unauthenticated fails at startup instead of warning.",
    )

    @field_validator("transfer_backend")
    @classmethod
    def _backend_list(cls, v: str) -> str:
        names = [n.strip() for n in v.split(",")]
        if any(not n for n in names):
            raise ValueError(
                f"transfer_backend {v!r}: empty backend name (expected 'auto', a name, or a "
                "comma-separated list such as 'nixl,tcp')"
            )
        if len(names) > 1 and AUTO in names:
            raise ValueError(
                f"transfer_backend {v!r}: 'auto' cannot be part of a list (it is a list itself)"
            )
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"transfer_backend {v!r}: {', '.join(dup)} listed twice")
        return ",".join(names)

    @field_validator("pools")
    @classmethod
    def _extra_pools_only(cls, v: dict[str, PoolConfig]) -> dict[str, PoolConfig]:
        if "kv" in v:
            raise ValueError(
                "pools names extra pools only: the KV pool ('kv') is set by staging, "
                "staging_options, index_mapper and index_mapper_options"
            )
        return v

    @property
    def backend_list(self) -> list[str]:
        """The configured backends in preference order (``['auto']`` for auto)."""
        return self.transfer_backend.split(",")

    def backend_options(self, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(own, shared)`` options of backend ``name`` from ``transfer_backend_options``.
        With one backend every option is its own. With a list, ``NAME.KEY`` entries (or a
        ``NAME`` entry holding a mapping) are that backend's own; plain ``KEY`` entries are
        shared: each listed backend whose options model has the field takes them (the
        selection refuses one that none has)."""
        opts = self.transfer_backend_options
        if len(self.backend_list) == 1:
            return dict(opts), {}
        listed = set(self.backend_list)
        own: dict[str, Any] = {}
        shared: dict[str, Any] = {}
        for key, value in opts.items():
            head, dot, rest = key.partition(".")
            if dot and head in listed:
                if head == name:
                    own[rest] = value
            elif key in listed:
                if not isinstance(value, dict):
                    raise ConfigError(
                        f"transfer_backend_options[{key!r}] must be a mapping of that "
                        f"backend's options, got {value!r}"
                    )
                if key == name:
                    own.update(value)
            else:
                shared[key] = value
        return own, shared

    @property
    def secret_bytes(self) -> bytes | None:
        """The shared secret as bytes, or None."""
        return self.secret.get_secret_value().encode() if self.secret else None


def parse_options(items: Sequence[str] | None, flag: str) -> dict[str, Any]:
    """Parse ``KEY=VALUE`` items; a VALUE that parses as JSON is taken as JSON."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def parse_pool_options(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Parse ``--pool-option POOL.KEY=VALUE`` items into a ``KVWireConfig.pools`` mapping."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in parse_options(items, "--pool-option").items():
        pool, dot, field = key.partition(".")
        if not dot or not pool or not field:
            raise ConfigError(f"--pool-option expects POOL.KEY=VALUE, got {key!r}")
        out.setdefault(pool, {})[field] = value
    return out


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add kvwire's options to an engine's argparse parser (one argument group)."""
    g = parser.add_argument_group("kvwire KV transfer")
    g.add_argument(
        "--transfer-backend",
        metavar="NAME",
        help="transfer engine: 'auto' (best usable per link), 'tcp', a plugin name such as "
        "'nixl', or a list in preference order such as 'nixl,tcp' (each link takes the first "
        "both sides can use and fails over to the next; env KVWIRE_TRANSFER_BACKEND; see "
        "`kvwire plugins` and `kvwire doctor`)",
    )
    g.add_argument(
        "--transfer-backend-option",
        metavar="KEY=VALUE",
        action="append",
        help="option of the selected backend; repeatable (JSON values accepted); with a list "
        "of backends, NAME.KEY=VALUE sets one backend's option (a plain KEY goes to each)",
    )
    g.add_argument("--index-mapper", metavar="NAME", help="index mapper (default: auto)")
    g.add_argument("--index-mapper-option", metavar="KEY=VALUE", action="append")
    g.add_argument(
        "--staging",
        metavar="NAME",
        help="staging strategy: 'auto' (default: bulk on GPU pools, direct on host pools), "
        "'direct', 'bulk' or a plugin's",
    )
    g.add_argument("--staging-option", metavar="KEY=VALUE", action="append")
    g.add_argument(
        "--pool-option",
        metavar="POOL.KEY=VALUE",
        action="append",
        help="how an extra pool is served, e.g. host.staging=direct, host.mapper=NAME, "
        "ssd.staging_options={...} (repeatable; see KVWireConfig.pools)",
    )
    g.add_argument(
        "--control-option",
        metavar="KEY=VALUE",
        action="append",
        help="control-plane option, e.g. heartbeat_interval_s=0.5, num_workers=8 (repeatable)",
    )


def config_from_args(
    args: argparse.Namespace | Mapping[str, Any], *, use_env: bool = True
) -> KVWireConfig:
    """Build a config from parsed arguments; unset arguments fall back to the environment."""
    ns = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    given: dict[str, Any] = {}
    for field in ("transfer_backend", "index_mapper", "staging"):
        if ns.get(field) is not None:
            given[field] = ns[field]
        opts = ns.get(f"{field}_option")
        if opts:
            given[f"{field}_options"] = parse_options(opts, f"--{field.replace('_', '-')}-option")
    if ns.get("pool_option"):
        given["pools"] = parse_pool_options(ns["pool_option"])
    if ns.get("control_option"):
        given["control"] = parse_options(ns["control_option"], "--control-option")
    try:
        if use_env:
            return KVWireConfig(**given)
        return KVWireConfig.model_validate({**KVWireConfig.model_construct().model_dump(), **given})
    except ValidationError as exc:
        raise ConfigError(f"invalid kvwire configuration: {exc}") from exc
