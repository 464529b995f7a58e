"""Options of the ``nixl`` backend and the environment an agent sets before it is created.

:class:`NixlOptions` is the backend's ``options_model`` (``--transfer-backend-option
key=value``); :func:`apply_env` and :data:`RW_UCX_ENV_DEFAULTS` are the UCX/NIXL environment
variables a :class:`~kvwire_nixl.backend.NixlBackend` applies in its constructor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_ENV_PREFIXES = ("UCX_", "NIXL_")


def _scalar_to_str(value: object, what: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    raise ValueError(f"{what} must be a string, number or boolean, got {type(value).__name__}")


class NixlOptions(BaseModel):
    """Options of the ``nixl`` backend (``--transfer-backend-option key=value``, JSON values)."""

    model_config = ConfigDict(extra="forbid")

    backends: list[str] = Field(
        default_factory=lambda: ["UCX"],
        min_length=1,
        description="NIXL backend plugins to create, in order (e.g. UCX, LIBFABRIC).",
    )
    backend_params: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description='Init parameters per backend, e.g. {"UCX": {"ucx_error_handling_mode": '
        '"none"}}; values are passed to NIXL as strings.',
    )
    ucx_env: dict[str, str] = Field(
        default_factory=dict,
        description="UCX_*/NIXL_* environment variables set before the agent is created, only "
        "where not already set (the process environment wins).",
    )
    num_threads: int = Field(
        default=0, ge=0, le=1024, description="Worker threads of multi-threaded backends."
    )
    progress: Literal["owner", "thread"] = Field(
        default="owner",
        description="owner: kvwire's owner loop drives progress (NIXL's thread off); "
        "thread: NIXL's own progress thread (busy-spins one core).",
    )
    sync_mode: Literal["none", "strict", "rw"] = Field(
        default="rw",
        description="NIXL's internal thread sync. rw: transfers post and complete "
        "concurrently (shared lock; peers, lists and memory take it exclusively); strict: "
        "NIXL serialises every call on one mutex; none: NIXL does not lock, so kvwire "
        "serialises every NIXL call of the agent on one lock of its own.",
    )
    transfer_timeout_s: float | None = Field(
        default=120.0, gt=0, description="A transfer not finished by then fails (None: never)."
    )

    @field_validator("backends", mode="before")
    @classmethod
    def _split_backends(cls, value: object) -> object:
        if isinstance(value, str):
            return [b.strip() for b in value.split(",") if b.strip()]
        return value

    @field_validator("backends")
    @classmethod
    def _unique_backends(cls, value: list[str]) -> list[str]:
        if any(not b for b in value):
            raise ValueError("backend names must be non-empty")
        if len(set(value)) != len(value):
            raise ValueError(f"backends are listed twice: {value}")
        return value

    @field_validator("backend_params", mode="before")
    @classmethod
    def _stringify_params(cls, value: object) -> object:
        if not isinstance(value, Mapping):
            return value
        out: dict[object, object] = {}
        for backend, params in value.items():
            if isinstance(params, Mapping):
                out[backend] = {
                    k: _scalar_to_str(v, f"backend_params[{backend!r}][{k!r}]")
                    for k, v in params.items()
                }
            else:
                out[backend] = params
        return out

    @field_validator("ucx_env", mode="before")
    @classmethod
    def _stringify_env(cls, value: object) -> object:
        if not isinstance(value, Mapping):
            return value
        return {k: _scalar_to_str(v, f"ucx_env[{k!r}]") for k, v in value.items()}

    @field_validator("ucx_env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not key.startswith(_ENV_PREFIXES) or not key.replace("_", "").isalnum():
                raise ValueError(
                    f"ucx_env key {key!r} is not a UCX_* or NIXL_* environment variable name"
                )
        return value

    @model_validator(mode="after")
    def _params_for_known_backends(self) -> NixlOptions:
        unknown = sorted(set(self.backend_params) - set(self.backends))
        if unknown:
            raise ValueError(
                f"backend_params names backends {unknown} that are not in backends {self.backends}"
            )
        return self

    def init_params(self, backend: str) -> dict[str, str]:
        """Init parameters passed to ``create_backend`` for ``backend``."""
        params = dict(self.backend_params.get(backend, {}))
        if self.num_threads and backend in ("UCX", "OBJ", "LIBFABRIC"):
            params.setdefault("num_threads", str(self.num_threads))
        elif self.num_threads and backend == "GDS_MT":
            params.setdefault("thread_count", str(self.num_threads))
        return params


def apply_env(env: Mapping[str, str]) -> dict[str, str]:
    """Set each variable of ``env`` not already in the environment; return those set."""
    applied = {}
    for key, value in env.items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied


#: UCX settings an agent with ``sync_mode="rw"`` applies before it is created, unless already
#: set (by the environment or ``ucx_env``). In that mode UCX runs its worker in multi-thread
#: mode, guarded by a spinlock by default; over ``cma`` the copy of a ``transfer`` runs inside
#: that lock, so other threads posting or checking transfers spin for milliseconds on cores
#: the copies need (measured on 2 vCPUs: 4 posting threads took ~40% longer). A mutex lets
#: them sleep. UCX reads it per context; it does not affect single-threaded workers.
RW_UCX_ENV_DEFAULTS = {"UCX_USE_MT_MUTEX": "y"}
