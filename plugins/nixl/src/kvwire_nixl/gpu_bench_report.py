"""What ``python -m kvwire_nixl.gpu_bench`` found: each method's times per case and per chunk
size, the summary, the markdown tables and the JSON record.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvwire_nixl.gpu_bench_args import TARGET_RATIO, Case, format_size


# ------------------------------------------------------------------------------- results
@dataclass
class MethodTimes:
    """Times of one method in one case, seconds."""

    total_s: list[float] = field(default_factory=list)
    submit_s: list[float] = field(default_factory=list)

    def add(self, total: float, submit: float) -> None:
        self.total_s.append(total)
        self.submit_s.append(submit)


@dataclass
class MethodResult:
    """One method in one case."""

    best_gbps: float
    median_gbps: float
    submit_us_median: float
    verified: bool


@dataclass
class CaseResult:
    """One throughput case, every method."""

    case: str
    descriptors: int
    descriptor_bytes: int
    bytes: int
    methods: dict[str, MethodResult]

    def ratio(self, a: str, b: str, stat: str = "best_gbps") -> float:
        """``a``'s GB/s over ``b``'s."""
        den = getattr(self.methods[b], stat)
        return getattr(self.methods[a], stat) / den if den else float("nan")

    @property
    def verified(self) -> bool:
        return all(m.verified for m in self.methods.values())


@dataclass
class ChunkResult:
    """One chunk size: medians in microseconds."""

    rows: int
    bytes: int
    reps: int
    submit_us: dict[str, float]
    e2e_us: dict[str, float]

    @property
    def kvwire_overhead_us(self) -> float:
        """kvwire's time to DONE minus raw prepared's."""
        return self.e2e_us["kvwire"] - self.e2e_us["raw_prepped"]

    @property
    def oneshot_over_prepped(self) -> float:
        """One-shot submit time over prepared submit time."""
        den = self.submit_us["raw_prepped"]
        return self.submit_us["raw_oneshot"] / den if den else float("nan")


def summarize(case: Case, times: dict[str, MethodTimes], verified: dict[str, bool]) -> CaseResult:
    """Throughput figures of one case from its raw times."""
    methods = {}
    for name, t in times.items():
        methods[name] = MethodResult(
            best_gbps=case.nbytes / min(t.total_s) / 1e9,
            median_gbps=case.nbytes / statistics.median(t.total_s) / 1e9,
            submit_us_median=statistics.median(t.submit_s) * 1e6,
            verified=verified[name],
        )
    return CaseResult(case.label, case.count, case.size, case.nbytes, methods)


def large_case(results: Sequence[CaseResult]) -> CaseResult | None:
    """The case of the largest descriptors (the "large request" of the target ratio)."""
    return max(results, key=lambda r: (r.descriptor_bytes, r.bytes), default=None)


def render(
    results: Sequence[CaseResult], chunks: Sequence[ChunkResult], meta: dict[str, Any]
) -> str:
    """Markdown tables of both parts, with a header line and the target verdict."""
    lines = [
        f"kvwire nixl GPU bench: WRITE {meta['memory']} {meta['initiator']} -> "
        f"{meta['target']}, one process per device, {meta['nixl']}, torch {meta['torch']}, "
        f"{meta.get('remote_layout', 'shuffled')} target rows, best of {meta['repeat']} "
        "(GB/s = 1e9 B/s)",
        "",
        "| case | kvwire GB/s | raw prepped GB/s | raw one-shot GB/s | torch peer GB/s "
        "| kvwire/torch | kvwire/raw | submit µs kvwire / prepped / one-shot | verified |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        m = r.methods
        lines.append(
            f"| {r.case} | {m['kvwire'].best_gbps:.1f} | {m['raw_prepped'].best_gbps:.1f} "
            f"| {m['raw_oneshot'].best_gbps:.1f} | {m['torch_peer'].best_gbps:.1f} "
            f"| {r.ratio('kvwire', 'torch_peer'):.2f} | {r.ratio('kvwire', 'raw_prepped'):.2f} "
            f"| {m['kvwire'].submit_us_median:.0f} / {m['raw_prepped'].submit_us_median:.0f} / "
            f"{m['raw_oneshot'].submit_us_median:.0f} | {'yes' if r.verified else 'NO'} |"
        )
    big = large_case(results)
    if big is not None:
        ratio = big.ratio("kvwire", "torch_peer")
        verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
        lines += [
            "",
            f"target kvwire >= {TARGET_RATIO}x torch peer copy for large requests ({big.case}): "
            f"{ratio:.2f}x, {verdict}",
        ]
    if chunks:
        lines += [
            "",
            f"chunks of {format_size(meta['chunk_row'])} rows picked at random from one prepared "
            "table, medians in µs (submit = the submitting call; e2e = submit to DONE)",
            "",
            "| rows | submit kvwire | submit prepped | submit one-shot | one-shot/prepped "
            "| e2e kvwire | e2e prepped | e2e one-shot | kvwire overhead | kvwire GB/s |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for c in chunks:
            s, e = c.submit_us, c.e2e_us
            lines.append(
                f"| {c.rows} | {s['kvwire']:.1f} | {s['raw_prepped']:.1f} "
                f"| {s['raw_oneshot']:.1f} | {c.oneshot_over_prepped:.2f} | {e['kvwire']:.1f} "
                f"| {e['raw_prepped']:.1f} | {e['raw_oneshot']:.1f} "
                f"| {c.kvwire_overhead_us:+.1f} | {c.bytes / e['kvwire'] / 1e3:.1f} |"
            )
    return "\n".join(lines)


def to_json(
    results: Sequence[CaseResult], chunks: Sequence[ChunkResult], meta: dict[str, Any]
) -> dict[str, Any]:
    """Every figure, with the ratios, as one JSON-ready dict."""
    cases = []
    for r in results:
        d = asdict(r)
        d["kvwire_over_torch"] = r.ratio("kvwire", "torch_peer")
        d["kvwire_over_raw_prepped"] = r.ratio("kvwire", "raw_prepped")
        d["kvwire_over_torch_median"] = r.ratio("kvwire", "torch_peer", "median_gbps")
        d["kvwire_over_raw_prepped_median"] = r.ratio("kvwire", "raw_prepped", "median_gbps")
        d["verified"] = r.verified
        cases.append(d)
    chunk_rows = []
    for c in chunks:
        d = asdict(c)
        d["kvwire_overhead_us"] = c.kvwire_overhead_us
        d["oneshot_over_prepped_submit"] = c.oneshot_over_prepped
        chunk_rows.append(d)
    big = large_case(results)
    target = None
    if big is not None:
        ratio = big.ratio("kvwire", "torch_peer")
        target = {
            "case": big.case,
            "ratio": ratio,
            "wanted": TARGET_RATIO,
            "met": ratio >= TARGET_RATIO,
        }
    return {"meta": meta, "cases": cases, "chunks": chunk_rows, "target": target}
