"""Versions of the plugin API: what a plugin was built against, and what this kvwire accepts.

A plugin's hook module declares the API it was written for::

    KVWIRE_PLUGIN_API = "2.0"

(a module without it was written before the API carried a version: it counts as ``"1.0"``).
The version covers the hook specifications (:class:`kvwire.plugins.KVWireSpecs`) and the
contracts of the seams (:class:`~kvwire.backend.TransferBackend`,
:class:`~kvwire.index.base.IndexMapper`, :class:`~kvwire.staging.base.StagingStrategy`).

===== ==============================================================================
API   what changed
===== ==============================================================================
1.0   first wave: the backend template held one lock around every hook, data path too
2.0   data-path hooks (``_submit``/``_poll``/``_release``, ``progress``,
      ``get_notifications``) are called concurrently with no template lock; the staging
      seam carries the strategy's own messages (``on_message``, ``on_arrival(ArrivedChunk)``,
      ``on_link``, ``writes_ended``, ``tick``)
===== ==============================================================================

Compatibility, checked when the plugin loads (an incompatible plugin is refused with both
versions named, and nothing else is affected):

* same major, minor not above ours: accepted;
* major 1: accepted for backends and mappers — a 1.x backend is called the 1.0 way, every hook
  under the template's lock (:func:`serialised_backend`); a 1.x staging strategy is refused
  when selected (its hooks changed in 2.0);
* anything else (a newer minor or major, an older unsupported major, a malformed string):
  refused.
"""

from __future__ import annotations

import re
from typing import Any

#: The plugin API this kvwire provides.
PLUGIN_API = "2.0"
#: Majors accepted (the current one, and those this kvwire adapts to).
SUPPORTED_MAJORS = (1, 2)
#: The version of a hook module that declares none (written before versions existed).
UNVERSIONED = "1.0"

_VERSION = re.compile(r"^(\d+)\.(\d+)$")


def parse(version: str) -> tuple[int, int]:
    """``"2.0"`` -> ``(2, 0)``; ValueError naming the string otherwise."""
    m = _VERSION.match(version.strip()) if isinstance(version, str) else None
    if m is None:
        raise ValueError(f"plugin API version {version!r} is not 'MAJOR.MINOR'")
    return int(m.group(1)), int(m.group(2))


def declared(module: Any) -> str:
    """The API version a hook module declares (``KVWIRE_PLUGIN_API``), or :data:`UNVERSIONED`."""
    value = getattr(module, "KVWIRE_PLUGIN_API", UNVERSIONED)
    return value if isinstance(value, str) else repr(value)


def incompatibility(version: str) -> str | None:
    """Why a plugin built for API ``version`` cannot load here, or None when it can."""
    ours = parse(PLUGIN_API)
    try:
        major, minor = parse(version)
    except ValueError as exc:
        return f"{exc}; this kvwire provides plugin API {PLUGIN_API}"
    if major not in SUPPORTED_MAJORS:
        newer = major > ours[0]
        return (
            f"built for kvwire plugin API {version}, this kvwire provides {PLUGIN_API} "
            f"(accepts majors {', '.join(map(str, SUPPORTED_MAJORS))}): "
            + ("upgrade kvwire" if newer else "rebuild the plugin against this kvwire")
        )
    if major == ours[0] and minor > ours[1]:
        return (
            f"built for kvwire plugin API {version}, newer than this kvwire's {PLUGIN_API}: "
            "upgrade kvwire"
        )
    return None


def is_legacy(version: str) -> bool:
    """Whether a plugin of this (compatible) version needs the 1.x adaptations."""
    try:
        return parse(version)[0] == 1
    except ValueError:
        return False


def serialised_backend(cls: type[Any]) -> type[Any]:
    """A subclass of a 1.x backend class whose data-path hooks run under the template's
    control lock, as the 1.0 template ran them: a backend written for that contract need not
    be thread-safe. Its name and capabilities are the original's."""

    class Serialised(cls):  # type: ignore[misc]
        def _submit(self, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return super()._submit(*args, **kwargs)

        def _poll(self, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return super()._poll(*args, **kwargs)

        def _release(self, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return super()._release(*args, **kwargs)

        def progress(self) -> None:
            with self._lock:
                super().progress()

        def get_notifications(self) -> Any:
            with self._lock:
                return super().get_notifications()

    Serialised.__name__ = Serialised.__qualname__ = f"{cls.__name__}Serialised"
    Serialised.__module__ = cls.__module__
    Serialised.__doc__ = f"{cls.__name__}, called the plugin API 1.0 way (every hook serialised)."
    Serialised.legacy_api = True
    return Serialised
