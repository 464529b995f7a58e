"""Prefill side: this rank's entry in its instance's bootstrap service (and, on prefill rank
0, the service itself).

Lock contract: none needed; built and closed on the engine's thread (manager start and
shutdown).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvwire.control.bootstrap import BootstrapClient, RankInfo
from kvwire.control.wire import PROTOCOL_MAJOR, PROTOCOL_MINOR
from kvwire.errors import BootstrapError, ConfigError
from kvwire.link_choice import host_identity

if TYPE_CHECKING:
    from kvwire.control.bootstrap_server import BootstrapServer
    from kvwire.session.context import RankContext

logger = logging.getLogger(__name__)


class Registration:
    """Registers a prefill rank with its bootstrap service, starting the service first when
    this is prefill rank 0 and no address was given (``control.run_bootstrap``)."""

    def __init__(self, ctx: RankContext, bootstrap_addr: str | None) -> None:
        opts = ctx.options
        r = ctx.layout.rank
        self.server: BootstrapServer | None = None
        if bootstrap_addr is None:
            if not (opts.run_bootstrap and r.tp_rank == 0 and r.pp_rank == 0 and r.dp_rank == 0):
                raise ConfigError(
                    f"prefill rank tp={r.tp_rank} pp={r.pp_rank} dp={r.dp_rank} needs "
                    "bootstrap_addr (the address prefill rank 0's bootstrap service listens on)"
                )
            from kvwire.control.bootstrap_server import BootstrapServer

            self.server = BootstrapServer(
                opts.bootstrap_host, opts.bootstrap_port, ctx.config.secret_bytes
            ).start()
            bootstrap_addr = self.server.address
        #: Where this rank registered (``host:port``).
        self.address: str = bootstrap_addr
        self.info = RankInfo(
            tp_rank=r.tp_rank,
            pp_rank=r.pp_rank,
            dp_rank=r.dp_rank,
            tp_size=r.tp_size,
            pp_size=r.pp_size,
            dp_size=ctx.dp_size,
            endpoint=ctx.channel.endpoint,
            agent=ctx.agent_name,
            session=ctx.session,
            protocol=PROTOCOL_MAJOR,
            protocol_minor=PROTOCOL_MINOR,
            backends=ctx.backend_names,
            backend_auto=ctx.backend_plan.auto,
            host=host_identity(),
        )
        self.client = BootstrapClient(bootstrap_addr, ctx.config.secret_bytes)

    def register(self, timeout_s: float) -> None:
        """Register, retrying while the service is not up yet (other ranks start at once)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.client.register(self.info)
                return
            except BootstrapError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        """Deregister (best effort) and stop the service if this rank runs it."""
        try:
            self.client.deregister(self.info)
        except BootstrapError as exc:
            logger.debug("deregister: %s", exc)
        if self.server is not None:
            self.server.stop()
