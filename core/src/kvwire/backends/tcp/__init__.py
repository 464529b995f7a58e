"""The ``tcp`` reference backend: a pure-Python transfer engine over ZeroMQ."""

from kvwire.backends.tcp.backend import TcpBackend
from kvwire.backends.tcp.options import TcpOptions

__all__ = ["TcpBackend", "TcpOptions"]
