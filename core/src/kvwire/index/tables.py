"""The pair of descriptor tables a mapper builds for one (source rank, destination rank)."""

from __future__ import annotations

from dataclasses import dataclass

from kvwire.descriptors import DescTable


@dataclass(frozen=True)
class TablePair:
    """Source and destination descriptor tables for one (source rank, destination rank)."""

    src: DescTable
    dst: DescTable

    @property
    def nbytes(self) -> int:
        """Host memory both tables take."""
        return int(self.src.nbytes + self.dst.nbytes)
