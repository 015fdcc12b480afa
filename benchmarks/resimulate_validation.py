"""A validation run predicted again, without a cluster: the simulator's changes checked in seconds.

    .venv/bin/python -m benchmarks.resimulate_validation REPORT.json --dump DIR \\
        [--set host_stream_interference=2.0 ...] [--json out.json]

`benchmarks/validate_sim.py --json REPORT.json --dump DIR` keeps what a run measured (each rate's
`records.jsonl` and `summary.json`, per repeat under `run-K/`) and how it simulated (the profile, each
shape's calibration, the workload settings). This simulates every row's requests again on the current
simulator with the row's calibration, `--set` replacing host figures (any `SimConfig` field, numbers:
a what-if, not a fit), and compares with the same measured runs, pooled as validate_sim pools them.
With no `--set` and an unchanged simulator it reproduces the report's predictions.

What it cannot say: whether a model change that helps here helps on another run. Figures chosen by
looking at these rows are fitted to them; a calibration has to find them before a fresh run counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from argparse import Namespace
from pathlib import Path
from typing import Any

from benchmarks.validate_sim_predict import SETTINGS, model_from_report, parse_shape, predict
from benchmarks.validate_sim_report import compare, format_row, pooled_summary, within_counts
from loadtest.records import read_jsonl
from sim.config import SimConfig


def measured_runs(folder: Path) -> list[tuple[list, dict]]:
    """(records, summary dict) of every run a validate_sim dump kept for one row."""
    runs = sorted(folder.glob("run-*"), key=lambda p: int(p.name.split("-")[1])) or [folder]
    out = []
    for run in runs:
        if not (run / "records.jsonl").exists():
            raise ValueError(f"--dump: no records.jsonl under {run}")
        out.append((read_jsonl(run / "records.jsonl"), json.loads((run / "summary.json").read_text())))
    return out


def resimulate(report: dict, dump: str, overrides: dict[str, Any] | None = None) -> list[dict]:
    """Every row of `report` predicted again (host figures replaced by `overrides`) against its dump."""
    if "settings" not in report:
        raise ValueError("the report has no 'settings' (an older validate_sim's report): cannot rebuild it")
    args = Namespace(**{key: report["settings"][key] for key in SETTINGS})
    rows = []
    for row in report["rows"]:
        shape_name, rate = row["shape"], row["rate_per_s"]
        profile, host = model_from_report(report, row.get("calibrated_on") or shape_name)
        if overrides:
            host = dataclasses.replace(host or SimConfig(), **overrides)
        seed = args.seed + args.rates.index(rate)  # validate_sim: each rate its own seed, in order
        predicted, _ = predict(parse_shape(shape_name), rate, seed, profile, host, args)
        runs = measured_runs(Path(dump) / f"{shape_name}_{rate:g}")
        measured = pooled_summary(runs)
        rows.append({"shape": shape_name, "rate_per_s": rate, **compare(measured, predicted)})
    return rows


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """FIELD=NUMBER items as {field: int or float}; a field SimConfig lacks, or no number, is refused."""
    names = {f.name for f in dataclasses.fields(SimConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in names:
            raise ValueError(f"--set: expected FIELD=NUMBER with a SimConfig field, got {item!r}")
        out[key] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="validate_sim's --json output")
    parser.add_argument("--dump", required=True, help="validate_sim's --dump folder of the same run")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=NUMBER", help="a host figure to replace")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dump):
        parser.error(f"--dump: {args.dump} is not a folder")
    try:
        rows = resimulate(json.loads(Path(args.report).read_text()), args.dump, parse_overrides(args.set))
    except ValueError as err:
        parser.error(str(err))
    for row in rows:
        print(format_row(row))
    within = within_counts(rows)
    print(f"within target ({len(rows)} runs): {within}, {sum(within.values())} of {5 * len(rows)} cells")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "within_target": within}, indent=1))


if __name__ == "__main__":
    main()
