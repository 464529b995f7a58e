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
from typing import Any

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvwire.errors import ConfigError

AUTO = "auto"


class KVWireConfig(BaseSettings):
    """Which implementations to use, and their options.

    Environment: ``KVWIRE_TRANSFER_BACKEND=nixl``,
    ``KVWIRE_TRANSFER_BACKEND_OPTIONS='{"host": "10.0.0.2"}'`` (JSON), and so on.
    """

    model_config = SettingsConfigDict(env_prefix="KVWIRE_", extra="forbid")

    transfer_backend: str = Field(default=AUTO, description="Backend name, or 'auto'.")
    transfer_backend_options: dict[str, Any] = Field(default_factory=dict)
    index_mapper: str = Field(default=AUTO, description="Mapper name, or 'auto' per layout.")
    index_mapper_options: dict[str, Any] = Field(default_factory=dict)
    staging: str = Field(default="direct", description="Staging strategy name.")
    staging_options: dict[str, Any] = Field(default_factory=dict)


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


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add kvwire's options to an engine's argparse parser (one argument group)."""
    g = parser.add_argument_group("kvwire KV transfer")
    g.add_argument(
        "--transfer-backend",
        metavar="NAME",
        help="transfer engine: 'auto' (best usable), 'tcp', or a plugin name such as 'nixl' "
        "(env KVWIRE_TRANSFER_BACKEND; see `kvwire plugins`)",
    )
    g.add_argument(
        "--transfer-backend-option",
        metavar="KEY=VALUE",
        action="append",
        help="option of the selected backend; repeatable (JSON values accepted)",
    )
    g.add_argument("--index-mapper", metavar="NAME", help="index mapper (default: auto)")
    g.add_argument("--index-mapper-option", metavar="KEY=VALUE", action="append")
    g.add_argument("--staging", metavar="NAME", help="staging strategy (default: direct)")
    g.add_argument("--staging-option", metavar="KEY=VALUE", action="append")


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
    try:
        if use_env:
            return KVWireConfig(**given)
        return KVWireConfig.model_validate({**KVWireConfig.model_construct().model_dump(), **given})
    except ValidationError as exc:
        raise ConfigError(f"invalid kvwire configuration: {exc}") from exc
