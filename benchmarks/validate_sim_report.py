"""The figures `benchmarks/validate_sim.py` compares, and how a row says predicted vs measured.

A row compares two summaries (dicts in `loadtest.summary.Summary.to_dict()`'s shape) on p50 / p99 TTFT
and TPOT and goodput, each against its bound (15% for goodput and p50s, 30% for p99s).

With `--repeats N` every rate is measured N times (the same requests; each repeat under a tenant of
its own, so that no repeat hits the prefix cache an earlier one filled) and a row also says:
- `pooled`: the prediction against the N runs together (their requests' latencies in one sample,
  their goodputs averaged), the primary comparison;
- `repeats`: the prediction against each run alone;
- `noise_floor`: the second run held against the first as if it were a prediction, the same
  bounds: how often two real runs of the same requests on this host agree within the targets, the
  ceiling no model of the cluster can beat here.

Every row also has `engine_busy`: per pool, the engines' summed step seconds and steps during the
bench (read from the workers' metrics, benchmarks/engine_busy.py; the runs' mean) beside the
simulation's busy time and steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

from loadtest.records import RequestRecord
from loadtest.stats import Distribution

METRICS = (
    ("ttft_p50", "ttft_ms", "p50", 0.15),
    ("ttft_p99", "ttft_ms", "p99", 0.30),
    ("tpot_p50", "tpot_ms", "p50", 0.15),
    ("tpot_p99", "tpot_ms", "p99", 0.30),
    ("goodput", "goodput_per_s", None, 0.15),
)


def figure(summary: dict, key: str, stat: str | None):
    value = summary[key]
    return value if stat is None else (value or {}).get(stat)


def compare(measured: dict, predicted: dict) -> dict:
    """Per metric: measured, predicted, relative error, and whether it is within its target."""
    row = {}
    for name, key, stat, bound in METRICS:
        m, p = figure(measured, key, stat), figure(predicted, key, stat)
        error = None if not m or p is None else (p - m) / m
        row[name] = {"measured": m, "predicted": p, "error": error, "within": error is not None and abs(error) <= bound}
    return row


def pooled_summary(runs: Sequence[tuple[Sequence[RequestRecord], dict]]) -> dict:
    """The figures `compare` reads, over the runs of one workload: (records, summary dict) each. One
    run: its summary. More: latency percentiles over every completed request of every run; goodput the
    runs' mean (each run's goodput is per second of its own span)."""
    if len(runs) == 1:
        return runs[0][1]
    done = [r for records, _ in runs for r in records if r.ok]
    goodputs = [summary["goodput_per_s"] for _, summary in runs]
    return {
        "ttft_ms": dataclasses.asdict(Distribution.of([r.ttft_s for r in done if r.ttft_s is not None], 1e3)),
        "tpot_ms": dataclasses.asdict(Distribution.of([r.tpot_s for r in done if r.tpot_s is not None], 1e3)),
        "goodput_per_s": None if None in goodputs else sum(goodputs) / len(goodputs),
        "requests_measured": sum(len(records) for records, _ in runs),
    }


def within_counts(rows: Sequence[dict], field: str | None = None) -> dict[str, int]:
    """Per metric, the rows (or their `field` comparison, when present) within the target."""
    chosen = [row if field is None else row[field] for row in rows if field is None or field in row]
    return {name: sum(r[name]["within"] for r in chosen) for name, *_ in METRICS}


def format_row(row: dict) -> str:
    cells = []
    for name, *_ in METRICS:
        m = row[name]
        if m["measured"] is None or m["predicted"] is None:
            cells.append(f"{name} -")
            continue
        error = "-" if m["error"] is None else f"{m['error']:+.0%}"
        cells.append(f"{name} {m['measured']:.1f}/{m['predicted']:.1f} ({error})")
    return f"{row['shape']:>5} @ {row['rate_per_s']:g}/s  " + "  ".join(cells)


def engine_busy(runs: Sequence[dict], result) -> dict:
    """Per pool: the engines' summed step seconds and steps, measured (the runs' mean, from
    benchmarks/engine_busy.py) beside the simulation's (`result`, a SimResult)."""
    out = {}
    for pool in ("prefill", "decode"):
        out[pool] = {
            "measured_s": sum(run[pool].seconds for run in runs) / len(runs),
            "simulated_s": result.busy_s.get(pool, 0.0),
            "measured_steps": sum(run[pool].steps for run in runs) / len(runs),
            "simulated_steps": result.steps.get(pool, 0),
        }
    return out


def print_row(row: dict, note: str, shared_host: bool) -> None:
    """The row (pooled when repeated), then each run, run 2 against run 1, and the unshared model."""
    print(format_row(row) + f"  [{note}]", flush=True)
    label = {"shape": "", "rate_per_s": row["rate_per_s"]}
    for k, repeat in enumerate(row.get("repeats", ())):
        print(f"{'':>14}run {k + 1}: " + format_row({**label, **repeat}), flush=True)
    if "noise_floor" in row:
        print(f"{'':>14}run 2 vs run 1: " + format_row({**label, **row["noise_floor"]}), flush=True)
    if shared_host:
        print(f"{'':>14}unshared: " + format_row({**label, **row["unshared"]}), flush=True)
    if "engine_busy" in row:
        busy = row["engine_busy"]
        print(
            f"{'':>14}engines stepped (measured / simulated): "
            + ", ".join(
                f"{pool} {b['measured_s']:.2f} / {b['simulated_s']:.2f} s in {b['measured_steps']:.0f} / "
                f"{b['simulated_steps']} steps"
                for pool, b in busy.items()
            ),
            flush=True,
        )


def dump_simulated(folder: str, records) -> None:
    """The simulated requests beside the bench's records.jsonl, one JSON line each (`--dump`)."""
    with open(os.path.join(folder, "sim_records.jsonl"), "w") as out:
        for record in records:
            out.write(json.dumps({**record._asdict(), "ttft_s": record.ttft_s, "tpot_s": record.tpot_s}) + "\n")
