"""Index mappers: layout pairs to descriptor tables, page indices to index arrays."""

from kvwire.index.base import IndexMapper, StagedSlice, TablePair, default_mapper_name
from kvwire.index.equal_tp import EqualTPMapper, MLAMapper
from kvwire.index.head_slice import HeadSliceMapper
from kvwire.index.ranks import source_ranks, target_ranks

__all__ = [
    "EqualTPMapper",
    "HeadSliceMapper",
    "IndexMapper",
    "MLAMapper",
    "StagedSlice",
    "TablePair",
    "default_mapper_name",
    "source_ranks",
    "target_ranks",
]
