"""kvwire."""
