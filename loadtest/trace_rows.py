"""Reading request traces: Mooncake FAST'25 JSON Lines and the Azure LLM inference CSV (2023 layout).

Formats (see tests/data/traces/README.md):
- mooncake: one JSON object a line with `timestamp` (ms from the trace's start), `input_length`,
  `output_length`, `hash_ids` (ids of the prompt's 512-token blocks, equal id = equal prefix block;
  `len(hash_ids) == ceil(input_length / 512)`).
- azure: CSV with header `TIMESTAMP,ContextTokens,GeneratedTokens`, TIMESTAMP as
  `YYYY-MM-DD HH:MM:SS.fffffff`; no prefix information.

The format is told by the file's content (a first line that opens a JSON object is Mooncake, the Azure
header is Azure), never by its name. A row that cannot be read is dropped and counted under its reason;
nothing is silently skipped.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_NAIVE_ORIGIN = datetime(2000, 1, 1)  # noqa: DTZ001 - Azure trace stamps carry no zone; only differences count


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float  # from the trace's first row
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None  # None: the format carries no prefix information


@dataclass(frozen=True)
class TraceFile:
    path: str
    format: str  # "mooncake" | "azure"
    rows: tuple[TraceRow, ...]
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows

    @property
    def rows_read(self) -> int:
        return len(self.rows) + sum(self.dropped.values())


class _Malformed(ValueError):
    """One row is unreadable; the message is the reason it is counted under."""


def _int_field(obj: dict, name: str) -> int:
    value = obj.get(name)
    if type(value) is not int:
        raise _Malformed(f"malformed: {name} missing or not an integer")
    return value


def _mooncake_row(line: str) -> tuple[float, int, int, tuple[int, ...] | None]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        raise _Malformed("malformed: not JSON") from None
    if not isinstance(obj, dict):
        raise _Malformed("malformed: not a JSON object")
    stamp_ms, input_length, output_length = (_int_field(obj, k) for k in ("timestamp", "input_length", "output_length"))
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(type(h) is int and h >= 0 for h in hash_ids):
        raise _Malformed("malformed: hash_ids missing or not non-negative integers")
    if input_length >= 1 and len(hash_ids) != -(-input_length // MOONCAKE_BLOCK_TOKENS):
        raise _Malformed("malformed: len(hash_ids) != ceil(input_length / 512)")
    return stamp_ms / 1000.0, input_length, output_length, tuple(hash_ids)


def _azure_row(line: str) -> tuple[float, int, int, tuple[int, ...] | None]:
    cells = next(csv.reader([line]))
    if len(cells) != 3:
        raise _Malformed("malformed: not 3 columns")
    try:
        # naive and zone-less: seconds since a fixed naive origin, so no local time zone leaks in
        stamp = (datetime.fromisoformat(cells[0].strip()) - _NAIVE_ORIGIN).total_seconds()
    except (ValueError, TypeError):  # TypeError: a zone-aware stamp
        raise _Malformed("malformed: bad TIMESTAMP") from None
    try:
        return stamp, int(cells[1]), int(cells[2]), None
    except ValueError:
        raise _Malformed("malformed: token counts not integers") from None


_PARSERS: dict[str, Callable[[str], tuple]] = {"mooncake": _mooncake_row, "azure": _azure_row}
FORMATS = tuple(_PARSERS)


def _lines(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line


def detect_format(path: Path) -> str:
    """'mooncake' or 'azure' from the first non-empty line; ValueError naming what was expected."""
    first = next(_lines(path), "")
    if first.lstrip().startswith("{"):
        return "mooncake"
    if tuple(c.strip() for c in next(csv.reader([first]), [])) == AZURE_HEADER:
        return "azure"
    raise ValueError(
        f"{path}: neither Mooncake JSON Lines (a JSON object a line) nor an Azure trace CSV "
        f"(header {','.join(AZURE_HEADER)})"
    )


def read_trace(path: str | Path, trace_format: str = "auto") -> TraceFile:
    """Every row of the trace, arrival times made relative to the first readable row and sorted
    (stable). Rows with a non-positive length are dropped too (nothing to send or nothing to time)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--trace {path}: no such file")
    fmt = detect_format(path) if trace_format == "auto" else trace_format
    if fmt not in _PARSERS:
        raise ValueError(f"unknown trace format {fmt!r}; known: auto, {', '.join(FORMATS)}")
    lines = _lines(path)
    if fmt == "azure":
        next(lines, None)  # the header
    parsed: list[tuple[float, int, int, tuple[int, ...] | None]] = []  # (stamp, input, output, hash ids)
    dropped: dict[str, int] = {}
    for line in lines:
        try:
            stamp, input_length, output_length, hash_ids = _PARSERS[fmt](line)
            if input_length < 1 or output_length < 1:
                raise _Malformed("non-positive input or output length")
        except _Malformed as err:
            dropped[str(err)] = dropped.get(str(err), 0) + 1
            continue
        parsed.append((stamp, input_length, output_length, hash_ids))
    first = min((p[0] for p in parsed), default=0.0)
    rows = sorted((TraceRow(s - first, i, o, h) for s, i, o, h in parsed), key=lambda r: r.arrival_s)
    return TraceFile(str(path), fmt, tuple(rows), dropped)
