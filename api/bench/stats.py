"""Summaries of what the load generator saw: percentiles, and what a proxy adds to the direct upstream.

"Added" figures are differences of percentiles measured in the same run at the same concurrency:
added TTFT p50 = the proxy's TTFT p50 minus the direct upstream's TTFT p50 (likewise for p99 and for
the gap between tokens). Milliseconds throughout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from api.bench.load import STALL_SECONDS, StreamSample


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`-th percentile (0 to 100) by linear interpolation between closest ranks; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def summarize(samples: Sequence[StreamSample], expected_tokens: int) -> dict[str, Any]:
    """TTFT and gap percentiles (ms) and how many streams were clean, lost or stalled."""
    ttfts = [sample.ttft for sample in samples if sample.ttft is not None]
    gaps = [gap for sample in samples for gap in sample.gaps]
    errors = [sample.error for sample in samples if sample.error is not None]
    return {
        "streams": len(samples),
        "clean": sum(sample.is_clean(expected_tokens) for sample in samples),
        "lost": len(errors),
        "stalled": sum(sample.error is None and sample.max_gap > STALL_SECONDS for sample in samples),
        "first_error": errors[0] if errors else None,
        "ttft_ms": {"p50": _ms(percentile(ttfts, 50)), "p99": _ms(percentile(ttfts, 99))},
        "gap_ms": {"p50": _ms(percentile(gaps, 50)), "p99": _ms(percentile(gaps, 99))},
        "tokens": sum(sample.tokens for sample in samples),
    }


def added(proxy: dict[str, Any], direct: dict[str, Any]) -> dict[str, Any]:
    """What `proxy` adds to `direct` (two `summarize` results at the same concurrency), in ms."""
    result: dict[str, Any] = {}
    for metric in ("ttft_ms", "gap_ms"):
        result[metric] = {q: _difference(proxy[metric][q], direct[metric][q]) for q in ("p50", "p99")}
    return result


def over_pace(summary: dict[str, Any], pace_ms: float) -> dict[str, Any]:
    """What a stream's gaps add to the pace its upstream keeps, in `added`'s shape (for the upstream
    measured directly, which has no baseline but its own pace)."""
    return {"gap_ms": {q: _difference(summary["gap_ms"][q], pace_ms) for q in ("p50", "p99")}}


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def is_held(summary: dict[str, Any], added_: dict[str, Any], max_added_gap_p99_ms: float) -> bool:
    """Whether a level of concurrent streams was held: every stream clean, and the added gap p99
    under the bound."""
    gap = added_["gap_ms"]["p99"]
    return bool(summary["clean"] == summary["streams"] and gap is not None and gap < max_added_gap_p99_ms)
