"""One request's outcome (`RequestRecord`), its derived latencies, and the records.jsonl file.

Times: `arrival_s` (when the plan had it due) and `send_s` (when it was issued: later under the
concurrency cap) are offsets from the run's start; `token_times_s` and `e2e_s` are from `send_s`, the
moment the router could first see the request. Tokens that came in one streamed message share its
arrival time.

Derived latencies (None where undefined):
- TTFT: arrival of the first token.
- TPOT: (last token - first token) / (output tokens - 1), for completed requests with >= 2 tokens.
- ITL: one value per output token after the first. A message carrying k tokens after a gap of g gives
  each of them g / k (the router streams per decode step batches, so a per-message gap would overstate
  the latency of every token in it); tokens that came with the first token get 0. So ITLs sum to
  last - first token time and their mean over a request is its TPOT.
- met_slo: completed (finish reason, no error) and TTFT <= its ttft SLO and TPOT <= its tpot SLO; an
  SLO not set is not judged, nor is TPOT for single-token outputs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    index: int  # position in the plan
    arrival_s: float
    send_s: float
    prompt_tokens: int
    max_tokens: int
    token_times_s: tuple[float, ...]  # one per output token received, from send_s
    e2e_s: float  # send -> last message, error or cancellation
    cached_prompt_tokens: int | None  # None: no route info came back
    finish_reason: str | None  # "stop" / "length"; None when it failed
    error_code: str | None  # gRPC status name, "CANCELLED" by the bench, or "CLIENT_ERROR"
    error_reason: str | None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    priority: int = 0
    tenant: str = ""
    token_ids: tuple[int, ...] = ()  # what the stream delivered, in order (chaos compares them with a replay)
    migrations: int = 0  # times the router moved the request to other workers (final message)

    @property
    def ok(self) -> bool:
        return self.finish_reason is not None and self.error_code is None

    @property
    def output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def end_s(self) -> float:
        return self.send_s + self.e2e_s

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> tuple[float, ...]:
        times, itls, k = self.token_times_s, [], 1
        while k < len(times) and times[k] == times[0]:
            itls.append(0.0)
            k += 1
        while k < len(times):
            end = k
            while end < len(times) and times[end] == times[k]:
                end += 1
            gap_s = times[k] - times[k - 1]
            itls.extend([gap_s / (end - k)] * (end - k))
            k = end
        return tuple(itls)

    @property
    def met_slo(self) -> bool:
        if not self.ok:
            return False
        if self.ttft_slo_ms is not None and self.ttft_s is not None and self.ttft_s * 1e3 > self.ttft_slo_ms:
            return False
        tpot_s = self.tpot_s
        return self.tpot_slo_ms is None or tpot_s is None or tpot_s * 1e3 <= self.tpot_slo_ms

    def to_dict(self) -> dict:
        """The fields plus the derived values, for the JSONL file."""
        return {
            **asdict(self),
            "output_tokens": self.output_tokens,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "itl_s": list(self.itl_s),
            "met_slo": self.met_slo,
        }

    @staticmethod
    def from_dict(raw: dict) -> RequestRecord:
        """Inverse of `to_dict` (derived values are recomputed, not trusted)."""
        values = {f.name: raw[f.name] for f in fields(RequestRecord) if f.name in raw}
        values["token_times_s"] = tuple(values.get("token_times_s", ()))
        values["token_ids"] = tuple(values.get("token_ids", ()))
        return RequestRecord(**values)


def write_jsonl(records: Iterable[RequestRecord], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record.to_dict()) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[RequestRecord]:
    with Path(path).open(encoding="utf-8") as f:
        return [RequestRecord.from_dict(json.loads(line)) for line in f if line.strip()]
