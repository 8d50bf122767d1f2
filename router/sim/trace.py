"""Reading Mooncake-format request traces (one JSON object per line)."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from halfmoon.router.errors import TraceFormatError


@dataclass(slots=True)
class TraceRecord:
    """One request of a trace, with its arrival already in seconds."""

    line_number: int
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    hash_ids: list[int]


def parse_line(path: str, line_number: int, line: str, time_scale: float) -> TraceRecord:
    """One trace line as a record; anything malformed is a TraceFormatError naming the line."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(path, line_number, f"not JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise TraceFormatError(path, line_number, "expected a JSON object")
    timestamp = data.get("timestamp")
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float):
        raise TraceFormatError(path, line_number, f"timestamp {timestamp!r} is not a number")
    if not math.isfinite(timestamp) or timestamp < 0:
        raise TraceFormatError(path, line_number, f"timestamp {timestamp!r} must be >= 0 ms")
    prompt = _count(path, line_number, data, "input_length", 1)
    output = _count(path, line_number, data, "output_length", 1)
    hash_ids = data.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise TraceFormatError(path, line_number, "hash_ids must be a list of integers")
    return TraceRecord(line_number, timestamp / 1000.0 / time_scale, prompt, output, hash_ids)


def _count(path: str, line_number: int, data: dict, name: str, minimum: int) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceFormatError(
            path, line_number, f"{name} {value!r} must be an integer >= {minimum}"
        )
    return value


def read_trace(
    path: str | Path, time_scale: float = 1.0, on_bad_line: str = "skip"
) -> tuple[list[TraceRecord], list[TraceFormatError]]:
    """All good records in arrival order, and the bad lines (each warned about on stderr).

    With `on_bad_line="fail"` the first bad line raises its TraceFormatError instead.
    """
    records: list[TraceRecord] = []
    bad: list[TraceFormatError] = []
    name = str(path)
    with open(path, encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(parse_line(name, line_number, line, time_scale))
            except TraceFormatError as exc:
                if on_bad_line == "fail":
                    raise
                print(f"warning: skipping {exc}", file=sys.stderr)
                bad.append(exc)
    records.sort(key=lambda r: r.arrival_s)
    return records, bad


def unbounded_hit_rate(records: list[TraceRecord]) -> float:
    """Fraction of blocks seen earlier in the trace: the hit rate of an infinite cache."""
    seen: set[int] = set()
    hits = total = 0
    for record in records:
        for key in record.hash_ids:
            if key in seen:
                hits += 1
            else:
                seen.add(key)
        total += len(record.hash_ids)
    return hits / total if total else 0.0
