"""The connector's options: ``kv_connector_extra_config`` mapped onto :mod:`kvwire.config`.

An operator writes kvwire's settings into vLLM's ``--kv-transfer-config`` JSON, under
``kv_connector_extra_config``::

    {"transfer_backend": "nixl", "control": {"host": "10.0.0.2"}, "bootstrap_port": 8998}

Every key of :class:`KVWireConfig` except the secret may appear there (``transfer_backend``,
``transfer_backend_options``, ``index_mapper``, ``staging``, ``control``, ...); keys not given
fall back to ``KVWIRE_*`` environment variables, as everywhere in kvwire. The shared secret
is read from ``KVWIRE_SECRET`` only: a secret in a JSON on a command line would be visible to
every user of the host. Both halves of the connector (scheduler process and every worker)
parse the same JSON with :func:`parse_extra_config`, so they agree on every value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvwire.config import KVWireConfig
from kvwire.errors import ConfigError
from kvwire_vllm.params import HostPort, check_host_port

#: Port of prefill rank 0's bootstrap service when the operator names none. The scheduler
#: process must know it (it hands the address to the router in ``kv_transfer_params``)
#: before the worker that runs the service exists, so it cannot be a port picked at random.
DEFAULT_BOOTSTRAP_PORT = 8998

#: ``KVWireConfig`` fields an operator may set through ``kv_connector_extra_config``.
KVWIRE_KEYS = (
    "transfer_backend",
    "transfer_backend_options",
    "index_mapper",
    "index_mapper_options",
    "staging",
    "staging_options",
    "pools",
    "control",
    "require_secret",
)


class ConnectorOptions(BaseModel):
    """``kv_connector_extra_config`` as the connector reads it (unknown keys are refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    transfer_backend: str | None = Field(
        default=None, description="kvwire backend ('tcp', 'nixl', 'mooncake', 'auto')."
    )
    transfer_backend_options: dict[str, Any] | None = None
    index_mapper: str | None = None
    index_mapper_options: dict[str, Any] | None = None
    staging: str | None = None
    staging_options: dict[str, Any] | None = None
    pools: dict[str, dict[str, Any]] | None = Field(
        default=None,
        description="kvwire KVWireConfig.pools: per extra pool, its mapper and staging "
        "strategy (e.g. {'host': {'staging': 'direct'}}).",
    )
    control: dict[str, Any] | None = Field(
        default=None, description="kvwire ControlOptions (host, timeouts, workers, ...)."
    )
    require_secret: bool | None = None
    bootstrap_addr: HostPort | None = Field(
        default=None,
        description="Prefill: 'host:port' of an already running bootstrap service (a "
        "standalone `kvwire bootstrap`); every prefill rank registers there and no rank runs "
        "one. Unset: prefill TP rank 0 runs it at control.bootstrap_host:bootstrap_port.",
    )
    bootstrap_port: int = Field(
        default=DEFAULT_BOOTSTRAP_PORT,
        gt=0,
        lt=65536,
        description="Port of the in-process bootstrap service (when bootstrap_addr is unset); "
        "overrides control.bootstrap_port.",
    )
    advertise_host: str | None = Field(
        default=None,
        description="Host the router passes to decode in kv_transfer_params (default: "
        "control.bootstrap_host). Set it when the service binds 0.0.0.0.",
    )
    push_chunk_blocks: int | None = Field(
        default=None,
        ge=1,
        description="Prefill: push a request's blocks in chunks of this many blocks, each "
        "landing and noted on its own, so a push that breaks part-way (prefill died, a chunk "
        "failed its checksum) keeps the chunks that landed and decode recomputes only the rest "
        "(with vLLM's kv_load_failure_policy='recompute'). Unset: one chunk per request.",
    )
    kv_pool: Literal["heads", "blocks"] = Field(
        default="heads",
        description="How workers describe the KV cache to kvwire: 'heads' (layer-major "
        "layouts: head slices move, so prefill and decode may differ in TP, block size and "
        "page order) or 'blocks' (whole blocks only: equal shapes on both sides).",
    )
    total_kv_heads: int | None = Field(
        default=None,
        ge=1,
        description="The model's total KV heads, when vLLM's model config is not available "
        "to the connector (default: from the model config, else heads per rank x TP).",
    )


def parse_extra_config(extra: Mapping[str, Any] | None) -> tuple[ConnectorOptions, KVWireConfig]:
    """Validate ``kv_connector_extra_config`` and build kvwire's config from it.

    Called by both halves of the connector at construction. Raises
    :class:`~kvwire.errors.ConfigError` naming the offending key.
    """
    raw = dict(extra or {})
    if "secret" in raw:
        raise ConfigError(
            "kv_connector_extra_config must not carry 'secret': set KVWIRE_SECRET in the "
            "environment of every prefill and decode process instead"
        )
    try:
        opts = ConnectorOptions.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"invalid kv_connector_extra_config for kvwire: {exc}") from exc
    given: dict[str, Any] = {
        k: getattr(opts, k) for k in KVWIRE_KEYS if getattr(opts, k) is not None
    }
    control = dict(given.get("control", {}))
    if opts.bootstrap_addr is None:
        control["bootstrap_port"] = opts.bootstrap_port
    else:
        control["run_bootstrap"] = False
    given["control"] = control
    try:
        config = KVWireConfig(**given)
    except ValidationError as exc:
        raise ConfigError(f"invalid kvwire settings in kv_connector_extra_config: {exc}") from exc
    return opts, config


def bootstrap_address(opts: ConnectorOptions, config: KVWireConfig) -> str:
    """Where prefill ranks register and decode looks them up (``host:port``): what the
    prefill's ``request_finished`` returns to the router in ``kv_transfer_params``."""
    if opts.bootstrap_addr is not None:
        return opts.bootstrap_addr
    host = opts.advertise_host or config.control.bootstrap_host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    addr = f"{host}:{config.control.bootstrap_port}"
    try:
        return check_host_port(addr)
    except ValueError as exc:
        raise ConfigError(
            f"kvwire-vllm: the bootstrap address for kv_transfer_params is not host:port "
            f"({exc}); check advertise_host / control.bootstrap_host"
        ) from None
