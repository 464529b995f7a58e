"""kvwire-sglang: SGLang's PD-disaggregation transfer layer implemented over kvwire.

Install it next to SGLang and start both instances with ``--disaggregation-transfer-backend
kvwire``: SGLang loads :func:`kvwire_sglang.plugin.register` through its ``sglang.srt.plugins``
entry point, which makes SGLang build :mod:`kvwire_sglang.conn`'s classes (subclasses of
SGLang's ``BaseKVManager``, ``BaseKVSender``, ``BaseKVReceiver``, ``BaseKVBootstrapServer``).
kvwire's options come from ``KVWIRE_*`` environment variables (``KVWIRE_TRANSFER_BACKEND=nixl``,
``KVWIRE_CONTROL__HOST=10.0.0.2``, ``KVWIRE_SECRET``), kvwire-sglang's from ``KVWIRE_SGLANG_*``
(:class:`kvwire_sglang.conn.SGLangOptions`). ``KVArgs`` becomes a kvwire layout in
:mod:`kvwire_sglang.layout`. Operator guide: ``docs/engines/sglang.md``.
"""

from kvwire_sglang.facts import EngineFacts, engine_facts
from kvwire_sglang.layout import UnsupportedKVArgsError, build_layout
from kvwire_sglang.plugin import BACKEND, register

__all__ = [
    "BACKEND",
    "EngineFacts",
    "UnsupportedKVArgsError",
    "build_layout",
    "engine_facts",
    "register",
]
