"""Runs a `BenchConfig`: asks the router for the model's limits, builds the plan, drives it, reports.

One run per rate of `--sweep` (or one run). Point i of a sweep builds its plan with token salt i: the
same arrivals pattern and lengths, fresh prompt tokens, so a later rate does not hit the prefix cache
the earlier ones filled. Output layout under `--out DIR`: `records.jsonl` + `summary.json`, or for a
sweep `rate-R/records.jsonl` + `rate-R/summary.json` per rate and `sweep.json`, whose
`max_rate_meeting_target` is the highest swept rate whose SLO attainment reached `--attainment-target`
(DistServe's per-GPU goodput, before dividing by the GPUs used).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from loadtest.backends import BackendError, make_backend
from loadtest.config import BenchConfig, read_token
from loadtest.driver import RunResult, drive
from loadtest.plan import ModelLimits, Plan
from loadtest.plots import plot_latency_cdfs, plot_sweep
from loadtest.records import write_jsonl
from loadtest.summary import Summary, format_table, summarize


class BenchError(Exception):
    """The bench cannot run: the server is unreachable or the workload does not fit the served model."""


async def _limits(backend) -> ModelLimits:
    try:
        return await backend.model_limits()
    except BackendError as err:
        raise BenchError(str(err)) from None


def _plan(config: BenchConfig, limits: ModelLimits, rate: float | None, salt: int) -> Plan:
    spec = config.spec.with_rate(rate) if rate is not None else config.spec
    try:
        return spec.build(limits, config.defaults, config.seed, salt)
    except ValueError as err:
        raise BenchError(f"cannot build the {config.workload} workload: {err}") from None


async def _prepared(backend, plan: Plan) -> Plan:
    """The plan as the backend sends it (the chat backend turns prompts into text first)."""
    prepare = getattr(backend, "prepare", None)
    if prepare is None:
        if any(r.prompt_text is not None and not r.prompt_token_ids for r in plan.requests):
            raise BenchError(f"the {plan.workload} workload sends text: use --backend openai-chat")
        return plan
    try:
        return await prepare(plan)
    except BackendError as err:
        raise BenchError(str(err)) from None


def _run_info(config: BenchConfig, limits: ModelLimits) -> dict:
    d = config.driver
    return {
        "target": config.target,
        "backend": config.backend,
        "workload": config.workload,
        "seed": config.seed,
        "max_concurrency": d.max_concurrency,
        "duration_s": d.duration_s,
        "grace_s": d.grace_s,
        "warmup_s": config.warmup_s,
        "temperature": d.temperature,
        "run_tag": d.run_tag,
        "model": dataclasses.asdict(limits),
    }


def _write_run(folder: Path, result: RunResult, summary: Summary, run_info: dict) -> None:
    write_jsonl(result.records, folder / "records.jsonl")
    (folder / "summary.json").write_text(json.dumps({**summary.to_dict(), "run": run_info}, indent=2) + "\n")


def sweep_report(points: list[tuple[float, Summary]], attainment_target: float) -> dict:
    """sweep.json: per-rate headline figures and the highest rate meeting the attainment target."""
    meeting = [rate for rate, s in points if s.slo_attainment is not None and s.slo_attainment >= attainment_target]
    return {
        "attainment_target": attainment_target,
        "max_rate_meeting_target": max(meeting, default=None),
        "points": [
            {
                "rate_per_s": rate,
                "slo_attainment": s.slo_attainment,
                "goodput_per_s": s.goodput_per_s,
                "request_throughput_per_s": s.request_throughput_per_s,
                "ttft_p99_ms": s.ttft_ms.p99,
                "tpot_p99_ms": s.tpot_ms.p99,
                "rejection_rate": s.rejection_rate,
            }
            for rate, s in sorted(points, key=lambda p: p[0])
        ],
    }


async def run_bench(config: BenchConfig, echo=print) -> list[Summary]:
    """Runs every point and writes what `--out` / `--plot` ask for; returns the summaries in run order."""
    token = read_token(config.auth_token_file)
    rates = config.sweep_rates or (None,)
    runs: list[tuple[float | None, RunResult, Summary]] = []
    backend = make_backend(
        config.backend,
        target=config.target,
        token=token,
        timeout_s=config.driver.request_timeout_s,
        model=config.model,
        tokenizer=config.tokenizer,
        **({"chat_format": config.chat_format or "plain"} if config.backend == "openai-chat" else {}),
        tls=config.tls,
    )
    async with backend:
        limits = await _limits(backend)
        run_info = _run_info(config, limits)
        for i, rate in enumerate(rates):
            plan = await _prepared(backend, _plan(config, limits, rate, i))
            echo(
                f"{config.workload}: {len(plan.requests)} requests planned"
                + (f" at {rate:g} req/s" if rate is not None else "")
            )
            driver = dataclasses.replace(config.driver, run_tag=f"{config.driver.run_tag}-{i}")
            result = await drive(backend, plan, driver)
            summary = summarize(
                result.records,
                workload=config.workload,
                planned=result.planned,
                warmup_s=config.warmup_s,
                rate_per_s=rate,
                notes=plan.notes,
            )
            echo(format_table(summary) + "\n")
            if config.out_dir is not None:
                folder = Path(config.out_dir) / (f"rate-{rate:g}" if rate is not None else "")
                _write_run(folder, result, summary, run_info)
            runs.append((rate, result, summary))
    _report_sweep_and_plots(config, runs, echo)
    return [summary for _, _, summary in runs]


def _report_sweep_and_plots(config: BenchConfig, runs, echo) -> None:
    points = [(rate, summary) for rate, _, summary in runs if rate is not None]
    if points:
        report = sweep_report(points, config.attainment_target)
        best = report["max_rate_meeting_target"]
        echo(
            f"sweep: highest rate with SLO attainment >= {config.attainment_target:.0%}: "
            + (f"{best:g} req/s" if best is not None else "none of the rates swept")
        )
        if config.out_dir is not None:
            (Path(config.out_dir) / "sweep.json").write_text(json.dumps(report, indent=2) + "\n")
    if config.plot_dir is not None:
        labelled = {
            (f"{rate:g} req/s" if rate is not None else config.workload): result.records for rate, result, _ in runs
        }
        written = plot_latency_cdfs(labelled, config.plot_dir)
        if points:
            written += plot_sweep(points, config.plot_dir, config.attainment_target)
        echo("plots: " + ", ".join(str(p) for p in written))
