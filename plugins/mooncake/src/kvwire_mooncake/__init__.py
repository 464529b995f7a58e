"""kvwire backend plugin for the Mooncake Transfer Engine (name ``mooncake``)."""

__all__: list[str] = []
