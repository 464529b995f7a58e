"""Find and import the installed NIXL Python build, with safe environment defaults.

NIXL ships one wheel per CUDA major version (``nixl-cu12`` imports as ``nixl_cu12``,
``nixl-cu13`` as ``nixl_cu13``) plus a ``nixl`` meta package that installs both. This module
picks one without importing the others:

1. ``KVWIRE_NIXL_MODULE`` (``nixl_cu12`` or ``nixl_cu13``) if set;
2. the only build installed (``nixl-cu12`` is the default dependency and also works on machines
   without a GPU; the ``cu13`` extra adds ``nixl-cu13``);
3. with both installed (the extra, or the ``nixl`` meta package), the one matching the CUDA
   major version of the installed torch build, read from ``torch/version.py`` without
   importing torch; ``nixl_cu12`` when torch is absent or built without CUDA.

Before the first import it sets ``UCX_MODULES=^efa`` unless the user set ``UCX_MODULES``:
with Debian's ``ibverbs-providers`` installed, UCX's EFA module loads a second copy of
libibverbs/libnl and every NIXL process segfaults at exit.

Importing this module does not import NIXL; :func:`load` does.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
import threading
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

#: Import names tried in order, with the distribution that provides each.
CANDIDATES: tuple[tuple[str, str], ...] = (
    ("nixl_cu12", "nixl-cu12"),
    ("nixl_cu13", "nixl-cu13"),
)
MODULE_ENV = "KVWIRE_NIXL_MODULE"
#: Environment defaults applied before NIXL (and so UCX) is first loaded, unless already set.
ENV_DEFAULTS = {"UCX_MODULES": "^efa"}

_lock = threading.Lock()
_loaded: NixlEngine | None = None
#: Environment variables this module set (not the user), for `kvwire doctor`.
applied_defaults: dict[str, str] = {}


@dataclass(frozen=True)
class NixlEngine:
    """The imported NIXL build."""

    module: str
    distribution: str
    version: str
    api: ModuleType
    bindings: ModuleType
    #: Every exception class the NIXL bindings define (nixlNotFoundError, ...).
    errors: tuple[type[BaseException], ...]


def apply_env_defaults() -> dict[str, str]:
    """Set :data:`ENV_DEFAULTS` for keys the user did not set; return what was set."""
    applied = {}
    for key, value in ENV_DEFAULTS.items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    applied_defaults.update(applied)
    return applied


def installed_candidates() -> list[tuple[str, str]]:
    """``(module, distribution)`` of every NIXL build that is installed (found without
    importing any of them)."""
    found = []
    for module, dist in CANDIDATES:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            found.append((module, dist))
    return found


def choose_module() -> tuple[str, str]:
    """The ``(module, distribution)`` :func:`load` would import; ImportError if none."""
    wanted = os.environ.get(MODULE_ENV, "").strip()
    found = installed_candidates()
    if wanted:
        for module, dist in found:
            if module == wanted:
                return module, dist
        names = ", ".join(m for m, _ in CANDIDATES)
        raise ImportError(
            f"{MODULE_ENV}={wanted!r} but that NIXL build is not installed (known: {names}; "
            f"installed: {', '.join(m for m, _ in found) or 'none'})"
        )
    if not found:
        raise ImportError(
            "no NIXL Python build is installed: install kvwire-nixl (it depends on nixl-cu12), "
            "or `pip install nixl-cu12` / `pip install nixl-cu13`"
        )
    if len(found) > 1 and torch_cuda_major() == 13:
        return next(c for c in found if c[0] == "nixl_cu13")
    return found[0]


def torch_cuda_major() -> int | None:
    """CUDA major version torch was built with, read from ``torch/version.py`` (torch is
    not imported: that takes seconds); None without torch or for a CPU-only build."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as fh:
                text = fh.read()
        except OSError:
            continue
        m = re.search(r"^cuda\b[^=]*=\s*['\"](\d+)\.", text, re.MULTILINE)
        return int(m.group(1)) if m else None
    return None


def _dist_version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def load() -> NixlEngine:
    """Import the chosen NIXL build once per process (after applying env defaults)."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        module, dist = choose_module()
        apply_env_defaults()
        quiet = "NIXL_LOG_LEVEL" not in os.environ
        api = importlib.import_module(f"{module}._api")
        bindings = importlib.import_module(f"{module}._bindings")
        if quiet:
            # NIXL's Python logger prints INFO lines to stdout; keep warnings and errors only.
            logging.getLogger("nixl").setLevel(logging.WARNING)
        errors = tuple(
            obj
            for name, obj in vars(bindings).items()
            if name.startswith("nixl")
            and name.endswith("Error")
            and isinstance(obj, type)
            and issubclass(obj, BaseException)
        )
        _loaded = NixlEngine(module, dist, _dist_version(dist), api, bindings, errors)
        return _loaded
