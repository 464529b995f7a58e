"""kvwire-nixl: the ``nixl`` transfer backend for kvwire (NIXL over UCX)."""

__version__ = "0.1.0"
