"""The ``tcp`` reference backend: a pure-Python transfer engine over ZeroMQ."""

from kvwire.backends.tcp.backend import TcpBackend, TcpOptions

__all__ = ["TcpBackend", "TcpOptions"]
