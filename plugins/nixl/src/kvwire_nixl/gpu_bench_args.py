"""The command line of ``python -m kvwire_nixl.gpu_bench``: sizes, cases, chunk sizes and
the :class:`Settings` a run uses (see :mod:`kvwire_nixl.gpu_bench` for what it measures).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

DEFAULT_CASES = "1x1GiB,4096x256KiB,65536x16KiB"
DEFAULT_CHUNKS = "1,64,1024,8192,65536"
DEFAULT_CHUNK_ROW = "16KiB"
#: The ratio to a torch peer copy that kvwire should reach for large requests.
TARGET_RATIO = 0.8
METHODS = ("kvwire", "raw_prepped", "raw_oneshot", "torch_peer")
NIXL_METHODS = METHODS[:3]

_UNITS = {"": 1, "b": 1, "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB}


# ----------------------------------------------------------------------------- arguments
def parse_size(text: str) -> int:
    """Bytes in ``text``: a whole number with an optional binary unit (``16KiB``, ``1g``)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 16KiB, 256MiB, 1GiB)")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def format_size(nbytes: int) -> str:
    """``nbytes`` with the largest binary unit that divides it (``256 KiB``, ``1 GiB``)."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True)
class Case:
    """One throughput case: ``count`` descriptors of ``size`` bytes."""

    count: int
    size: int

    @property
    def nbytes(self) -> int:
        return self.count * self.size

    @property
    def label(self) -> str:
        return f"{self.count} x {format_size(self.size)}"


def parse_cases(text: str) -> list[Case]:
    """Cases from ``COUNTxSIZE`` items separated by commas (``1x1GiB,4096x256KiB``)."""
    cases = []
    for item in text.split(","):
        if not item.strip():
            continue
        count, sep, size = item.strip().partition("x")
        if not sep or not count.strip().isdigit():
            raise ValueError(f"a case is COUNTxSIZE (e.g. 4096x256KiB), got {item.strip()!r}")
        case = Case(int(count), parse_size(size))
        if case.count <= 0:
            raise ValueError(f"case {item.strip()!r} has no descriptors")
        if case.size % 8:
            raise ValueError(f"case {item.strip()!r}: the size must be a multiple of 8 bytes")
        cases.append(case)
    if not cases:
        raise ValueError("no case given")
    return cases


def parse_chunks(text: str) -> list[int]:
    """Chunk sizes (descriptors per chunk) separated by commas; an empty string: none."""
    out = []
    for item in text.split(","):
        if item.strip():
            if not item.strip().isdigit() or int(item) <= 0:
                raise ValueError(f"a chunk size is a positive whole number, got {item.strip()!r}")
            out.append(int(item))
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kvwire_nixl.gpu_bench``."""
    p = argparse.ArgumentParser(
        prog="python -m kvwire_nixl.gpu_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="memory to use")
    p.add_argument("--gpu", type=int, default=0, help="the initiator's GPU (this process)")
    p.add_argument("--target-gpu", type=int, default=1, help="the target process's GPU")
    p.add_argument("--cases", default=DEFAULT_CASES, help="COUNTxSIZE,... (WRITE cases)")
    p.add_argument("--repeat", type=int, default=30, help="timed rounds per case")
    p.add_argument(
        "--chunks", default=DEFAULT_CHUNKS, help="descriptors per chunk, comma-separated ('' none)"
    )
    p.add_argument("--chunk-row", default=DEFAULT_CHUNK_ROW, help="bytes per chunk descriptor")
    p.add_argument(
        "--chunk-repeat", type=int, default=50, help="timed rounds per chunk size (fewer for big)"
    )
    p.add_argument(
        "--option",
        action="append",
        metavar="KEY=VALUE",
        help="nixl backend option (JSON values accepted); repeatable",
    )
    p.add_argument(
        "--remote-layout",
        choices=("shuffled", "contiguous"),
        default="shuffled",
        help="target rows: shuffled over twice the span (nothing can merge; the default) or "
        "contiguous in order (NIXL may merge neighbouring descriptors)",
    )
    p.add_argument("--json", metavar="PATH", help="write every figure to this file")
    return p


@dataclass
class Settings:
    """Parsed and checked arguments."""

    device: str
    gpu: int
    target_gpu: int
    cases: list[Case]
    repeat: int
    chunks: list[int]
    chunk_row: int
    chunk_repeat: int
    options: dict[str, Any]
    json_path: str | None
    remote_layout: str = "shuffled"

    @property
    def local_device(self) -> str:
        return f"cuda:{self.gpu}" if self.device == "cuda" else "cpu"

    @property
    def target_device(self) -> str:
        return f"cuda:{self.target_gpu}" if self.device == "cuda" else "cpu"

    @property
    def source_bytes(self) -> int:
        """Bytes of the source buffer: the largest case, or the chunk table if larger."""
        chunk_span = max(self.chunks, default=0) * self.chunk_row
        return max([c.nbytes for c in self.cases] + [chunk_span])


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """Parse and check the command line (argparse errors exit with status 2)."""
    from kvwire.config import parse_options

    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        cases = parse_cases(a.cases)
        chunks = parse_chunks(a.chunks)
        chunk_row = parse_size(a.chunk_row)
        options = parse_options(a.option, "--option")
    except Exception as exc:
        parser.error(str(exc))
    if chunk_row % 8:
        parser.error("--chunk-row must be a multiple of 8 bytes")
    if a.repeat < 1 or a.chunk_repeat < 1:
        parser.error("--repeat and --chunk-repeat must be at least 1")
    if a.device == "cuda" and a.gpu == a.target_gpu:
        parser.error("--gpu and --target-gpu must differ (one process per GPU)")
    return Settings(
        a.device,
        a.gpu,
        a.target_gpu,
        cases,
        a.repeat,
        chunks,
        chunk_row,
        a.chunk_repeat,
        options,
        a.json,
        a.remote_layout,
    )


def chunk_reps(rows: int, repeat: int) -> int:
    """Timed rounds for a chunk of ``rows`` descriptors: ``repeat``, fewer above 1024 rows."""
    if rows <= 1024:
        return repeat
    return max(10, repeat * 1024 // rows)
