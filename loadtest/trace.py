"""The `trace` workload: replays a Mooncake or Azure trace (`trace_rows`) against the served model.

1. Lengths. Prompt lengths are multiplied by `prompt_scale`, output lengths by `output_scale` (rounded,
   at least 1). `prompt_scale=None` (auto) is block_size / 512 for Mooncake, so each 512-token trace
   block becomes exactly one KV block of the model, and 1 for Azure. For Mooncake, 512 x prompt_scale is
   the size of the synthetic block each hash id maps to and must be a whole number of tokens.
2. Fit. A row whose scaled prompt + output exceeds max_model_len is dropped (`overflow="drop"`, counted
   under its reason) or clipped (`overflow="clip"`: prompt to max_model_len - 1, then output to what is
   left; counted as clipped), until `num_requests` rows are planned; later rows are not considered
   (`rows_beyond_num_requests`). So rows_read = planned + dropped (every reason) + beyond.
3. Time. Arrivals are relative to the first kept row. `spread_s` > 0 adds a seeded uniform [0, spread_s)
   offset to each (the Mooncake conversation trace is bucketed to ~3 s: spread_s=3 smooths its bursts;
   0 replays them as recorded), then sorts. Times are divided by `speedup`, or, when `rate_per_s` is
   given, by the speed-up that makes the kept rows' mean rate (rows / span) equal it.
4. Tokens. Mooncake: hash id h becomes block (TRACE_BLOCK, h) of `TokenSource`, the prompt is
   concat(block(h) for h in hash_ids)[:prompt_len], so equal leading ids give token-identical prefixes
   and the cluster sees the trace's real sharing. Azure: one unique prompt per row (no-reuse control).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from loadtest import tokens
from loadtest.plan import ModelLimits, Plan, RequestDefaults, make_requests
from loadtest.trace_rows import FORMATS, MOONCAKE_BLOCK_TOKENS, TraceFile, TraceRow, read_trace

OVERFLOW_POLICIES = ("drop", "clip")
_SPREAD = 1
TOO_LONG = "exceeds max_model_len after scaling"


class TraceLayout(NamedTuple):
    """What `TraceSpec.layout` plans, before any token id is made."""

    trace: TraceFile
    rows: list[int]  # indices into trace.rows, in arrival order
    lengths: list[tuple[int, int]]  # (prompt, output) tokens of each, after scaling and fitting
    arrivals_s: np.ndarray
    prompt_scale: float
    notes: dict


@dataclass(frozen=True)
class TraceSpec:
    path: str
    trace_format: str = "auto"
    speedup: float = 1.0  # ignored when rate_per_s is set
    rate_per_s: float | None = None
    prompt_scale: float | None = None  # None: auto (see the module docstring)
    output_scale: float = 1.0
    overflow: str = "drop"
    spread_s: float = 0.0
    num_requests: int | None = None

    def __post_init__(self):
        if not Path(self.path).is_file():
            raise ValueError(f"--trace {self.path}: no such file")
        if self.trace_format not in ("auto", *FORMATS):
            raise ValueError(f"--trace-format must be one of auto, {', '.join(FORMATS)}; got {self.trace_format!r}")
        for flag, value in (
            ("--trace-speedup", self.speedup),
            ("--rate", self.rate_per_s),
            ("--trace-prompt-scale", self.prompt_scale),
            ("--trace-output-scale", self.output_scale),
        ):
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{flag} must be a finite number > 0, got {value}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"--trace-overflow must be one of {', '.join(OVERFLOW_POLICIES)}; got {self.overflow!r}")
        if not (self.spread_s >= 0 and math.isfinite(self.spread_s)):
            raise ValueError(f"--trace-spread-s must be a finite number >= 0, got {self.spread_s}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")

    def with_rate(self, rate_per_s: float) -> TraceSpec:
        return dataclasses.replace(self, rate_per_s=rate_per_s)

    def build(self, limits: ModelLimits, defaults: RequestDefaults, seed: int, salt: int = 0) -> Plan:
        """The plan; deterministic in (self, the file, limits, defaults, seed, salt). ValueError when no
        row fits or the scaling is impossible."""
        layout = self.layout(limits, seed)
        prompts = _prompts(
            layout.trace,
            layout.rows,
            [p for p, _ in layout.lengths],
            layout.prompt_scale,
            tokens.TokenSource(limits, seed, salt),
        )
        return Plan(
            "trace", make_requests(layout.arrivals_s, prompts, [o for _, o in layout.lengths], defaults), layout.notes
        )

    def layout(self, limits: ModelLimits, seed: int) -> TraceLayout:
        """Which rows are planned, in arrival order, with their lengths and times (steps 1-3 above; no
        tokens yet: the simulator reads a trace's prefix sharing from its hash ids directly)."""
        trace = _read(self.path, self.trace_format)
        prompt_scale = self._prompt_scale(trace.format, limits)
        kept, lengths, dropped, clipped = self._fit(trace, prompt_scale, limits.max_model_len)
        if not kept:
            raise ValueError(
                f"no row of {self.path} fits max_model_len {limits.max_model_len} after scaling (dropped: {dropped})"
            )
        beyond = len(trace.rows) - (kept[-1] + 1)  # rows after the last one planned: never considered
        arrivals_s, order, speedup = self._timeline([trace.rows[i] for i in kept], seed)
        kept, lengths = [kept[i] for i in order], [lengths[i] for i in order]
        notes = {
            "trace": self.path,
            "format": trace.format,
            "rows_read": trace.rows_read,
            "rows_dropped": {**trace.dropped, **dropped},
            "rows_clipped": clipped,
            "rows_beyond_num_requests": beyond,
            "rows_planned": len(kept),
            "prompt_scale": prompt_scale,
            "output_scale": self.output_scale,
            "overflow": self.overflow,
            "speedup": speedup,
            "target_rate_per_s": self.rate_per_s,
            "bursts": f"spread uniformly over {self.spread_s:g} s" if self.spread_s else "as recorded",
        }
        return TraceLayout(trace, kept, lengths, arrivals_s, prompt_scale, notes)

    def _prompt_scale(self, fmt: str, limits: ModelLimits) -> float:
        if fmt != "mooncake":
            return self.prompt_scale or 1.0
        scale = self.prompt_scale or limits.block_size / MOONCAKE_BLOCK_TOKENS
        block_tokens = scale * MOONCAKE_BLOCK_TOKENS
        if abs(block_tokens - round(block_tokens)) > 1e-9 or round(block_tokens) < 1:
            raise ValueError(
                f"--trace-prompt-scale {scale:g} maps a 512-token Mooncake block to "
                f"{block_tokens:g} tokens; it must be a whole number >= 1"
            )
        return scale

    def _fit(self, trace: TraceFile, prompt_scale: float, max_model_len: int):
        """(indices of rows kept, their (prompt, output) lengths, dropped by reason, rows clipped), over
        the rows up to the `num_requests`-th that fits."""
        kept: list[int] = []
        dropped: dict[str, int] = {}
        lengths, clipped = [], 0
        for i, row in enumerate(trace.rows):
            if len(kept) == self.num_requests:
                break
            prompt = max(1, round(row.input_length * prompt_scale))
            output = max(1, round(row.output_length * self.output_scale))
            if prompt + output > max_model_len:
                if self.overflow == "drop":
                    dropped[TOO_LONG] = dropped.get(TOO_LONG, 0) + 1
                    continue
                prompt = min(prompt, max_model_len - 1)
                output = min(output, max_model_len - prompt)
                clipped += 1
            kept.append(i)
            lengths.append((prompt, output))
        return kept, lengths, dropped, clipped

    def _timeline(self, rows: list[TraceRow], seed: int) -> tuple[np.ndarray, np.ndarray, float]:
        """(sorted arrival offsets in s, the order that sorts the rows, the speed-up applied)."""
        times_s = np.array([r.arrival_s for r in rows])
        if self.spread_s:
            times_s = times_s + np.random.default_rng([seed, _SPREAD]).uniform(0.0, self.spread_s, len(rows))
        order = np.argsort(times_s, kind="stable")
        times_s = times_s[order] - times_s[order[0]]
        speedup = self.speedup
        if self.rate_per_s is not None:
            span_s = float(times_s[-1])
            if span_s <= 0:
                raise ValueError("--rate cannot be met by rescaling: the selected trace rows all arrive at once")
            speedup = self.rate_per_s / (len(rows) / span_s)
        return times_s / speedup, order, speedup


@functools.lru_cache(maxsize=4)
def _read(path: str, trace_format: str) -> TraceFile:
    """A rate sweep builds one plan per rate from the same file: read it once."""
    return read_trace(path, trace_format)


def _hash_ids(row: TraceRow) -> tuple[int, ...]:
    assert row.hash_ids is not None, "mooncake rows carry hash_ids"
    return row.hash_ids


def _prompts(
    trace: TraceFile, kept: list[int], prompt_lens: list[int], prompt_scale: float, source: tokens.TokenSource
) -> list[list[int]]:
    if trace.format != "mooncake":
        return [source.blocks(tokens.TRACE_PROMPT, [i], n)[0].tolist() for i, n in zip(kept, prompt_lens, strict=True)]
    block_tokens = round(prompt_scale * MOONCAKE_BLOCK_TOKENS)
    unique_ids = sorted({h for i in kept for h in _hash_ids(trace.rows[i])})
    blocks = source.blocks(tokens.TRACE_BLOCK, unique_ids, block_tokens)
    slot = {h: k for k, h in enumerate(unique_ids)}
    prompts = []
    for i, n in zip(kept, prompt_lens, strict=True):
        ids = _hash_ids(trace.rows[i])[: -(-n // block_tokens)]  # only the blocks the (clipped) prompt needs
        prompts.append(blocks[[slot[h] for h in ids]].reshape(-1)[:n].tolist())
    return prompts
