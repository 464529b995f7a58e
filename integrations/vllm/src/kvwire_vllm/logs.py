"""kvwire's log records in vLLM's logs, with vLLM's format and level.

vLLM configures one logger, ``vllm`` (its handler, formatter and ``VLLM_LOGGING_LEVEL``),
with ``propagate=False``; kvwire's loggers (``kvwire``, its plugins', ``kvwire_vllm``) are
outside that tree, so without this their INFO lines never show and their warnings come out
bare (Python's last-resort handler). :func:`adopt_vllm_logging` hangs them on vLLM's handlers
at vLLM's level, in every process the connector is built in (the engine core's scheduler
and every worker).

An operator's own configuration wins: a kvwire logger that already has handlers (e.g. named
in ``VLLM_LOGGING_CONFIG_PATH``) is left alone, and with ``VLLM_CONFIGURE_LOGGING=0`` (no
handler on ``vllm``) nothing is changed.
"""

from __future__ import annotations

import logging

#: The loggers of kvwire's distributions (each module logs under ``logging.getLogger(__name__)``).
KVWIRE_LOGGERS = (
    "kvwire",
    "kvwire_nixl",
    "kvwire_mooncake",
    "kvwire_hisparse",
    "kvwire_cudaipc",
    "kvwire_vllm",
)
_ADOPTED = "_kvwire_vllm_adopted"


def adopt_vllm_logging() -> list[str]:
    """Give kvwire's loggers vLLM's handlers and level; the names adopted.

    Called by :class:`~kvwire_vllm.connector.KVWireConnector` when vLLM builds it (both
    roles); idempotent (a later call picks up vLLM's current handlers and level).
    """
    vllm = logging.getLogger("vllm")
    handlers = list(vllm.handlers)
    if not handlers:
        return []
    done = []
    for name in KVWIRE_LOGGERS:
        lg = logging.getLogger(name)
        ours = getattr(lg, _ADOPTED, False)
        if lg.handlers and not ours:
            continue  # configured by the operator
        lg.handlers = list(handlers)
        lg.setLevel(vllm.level)
        lg.propagate = False
        setattr(lg, _ADOPTED, True)
        done.append(name)
    return done
