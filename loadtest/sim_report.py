"""A simulation's result as `splitserve bench` reports a run: the same `Summary`, table and JSON.

Every figure is defined as in loadtest/summary.py; the simulator has no per-token message times, so
ITL is left empty (count 0) and the notes say the run was simulated and from which profile.
"""

from __future__ import annotations

from loadtest.stats import Distribution
from loadtest.summary import REJECTED, Summary
from sim.profile import Profile
from sim.result import SimResult


def sim_summary(
    result: SimResult,
    profile: Profile,
    *,
    workload: str,
    notes: dict | None = None,
    warmup_s: float = 0.0,
    rate_per_s: float | None = None,
) -> Summary:
    measured = [r for r in result.records if r.arrival_s >= warmup_s]
    done = [r for r in measured if r.ok]
    duration_s = (max(r.end_s for r in measured) - min(r.send_s for r in measured)) if measured else 0.0
    met = sum(r.met(result.ttft_slo_s, result.tpot_slo_s) for r in measured)
    errors = {}
    for status, key in (
        ("rejected", f"{REJECTED}: refused by the simulated router"),
        ("failed", "UNAVAILABLE: migration limit reached"),
    ):
        count = sum(r.status == status for r in measured)
        if count:
            errors[key] = count
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)

    def ratio(a: float, b: float):
        return a / b if b > 0 else None

    slo = {
        "ttft_ms": None if result.ttft_slo_s is None else result.ttft_slo_s * 1e3,
        "tpot_ms": None if result.tpot_slo_s is None else result.tpot_slo_s * 1e3,
    }
    sim_notes = {**(notes or {}), "simulated": f"{result.config_name} on profile: {profile.label}"}
    return Summary(
        workload=workload,
        requests_planned=len(result.records),
        requests_not_issued=0,
        requests_warmup=len(result.records) - len(measured),
        requests_measured=len(measured),
        requests_completed=len(done),
        requests_failed=len(measured) - len(done),
        duration_s=duration_s,
        request_throughput_per_s=ratio(len(done), duration_s),
        output_token_throughput_per_s=ratio(sum(r.output_tokens for r in done), duration_s),
        goodput_per_s=ratio(met, duration_s),
        slo_attainment=ratio(met, len(measured)),
        ttft_ms=Distribution.of([r.ttft_s for r in done if r.ttft_s is not None], 1e3),  # all set when ok
        tpot_ms=Distribution.of([r.tpot_s for r in done if r.tpot_s is not None], 1e3),
        itl_ms=Distribution.of([]),
        e2e_ms=Distribution.of([r.end_s - r.send_s for r in done], 1e3),
        errors=errors,
        rejection_rate=ratio(sum(r.status == "rejected" for r in measured), len(measured)),
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        prefix_hit_rate=ratio(cached, prompt),
        slo=slo,
        rate_per_s=rate_per_s,
        notes=sim_notes,
    )
