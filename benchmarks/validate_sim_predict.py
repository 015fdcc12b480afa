"""The prediction side of `benchmarks/validate_sim.py`: the requests a validation bench sends at a rate,
simulated on a calibrated profile, and the same model rebuilt from a validation report.

A report (validate_sim `--json`) holds the measured profile, each shape's calibration (overheads, host
figures) and the workload `SETTINGS`; `model_from_report` turns a calibration back into the profile and
host the run simulated with, so that `benchmarks/resimulate_validation.py` can predict the very rows
again, or with changed figures, without a cluster.
"""

from __future__ import annotations

import dataclasses

from loadtest.lengths import LengthDist
from loadtest.poisson import PoissonSpec
from loadtest.sim_report import sim_summary
from loadtest.sim_workload import limits_of, sim_requests
from sim.config import SimConfig
from sim.profile import Profile
from sim.simulator import simulate
from sim.worker import EngineLimits

# The workload and client settings a report records.
SETTINGS = ("rates", "num_requests", "prompt_len", "output_len", "ttft_ms", "tpot_ms", "max_concurrency", "seed")


def parse_shape(text: str) -> tuple[int, int]:
    """ "2P1D" -> (2, 1): prefill workers, decode instances."""
    prefill, _, decode = text.upper().rstrip("D").partition("P")
    return int(prefill), int(decode)


def spec_for(args, rate: float) -> PoissonSpec:
    return PoissonSpec(args.num_requests, rate, LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len))


def predict(shape: tuple[int, int], rate: float, seed: int, profile: Profile, host: SimConfig | None, args):
    """(summary dict, SimResult): the simulation of the requests the bench sends at `rate` with `seed`."""
    requests, notes = sim_requests(spec_for(args, rate), limits_of(profile), profile.model.block_size, seed)
    result = simulate(sim_config(shape, args, host), profile, requests)
    return sim_summary(result, profile, workload="poisson", notes=notes).to_dict(), result


def sim_config(shape: tuple[int, int], args, host: SimConfig | None) -> SimConfig:
    """The shape with the bench's SLO and client; `host`: the host's figures (None: not shared)."""
    return dataclasses.replace(
        host or SimConfig(),
        prefill=shape[0],
        decode=shape[1],
        limits=EngineLimits(),
        ttft_slo_s=args.ttft_ms / 1e3,
        tpot_slo_s=args.tpot_ms / 1e3,
        max_concurrency=args.max_concurrency,
    )


def model_from_report(report: dict, shape_name: str) -> tuple[Profile, SimConfig | None]:
    """The profile with `shape_name`'s calibrated overheads, and its host figures (None: not shared)."""
    calibration = next((c for c in report["calibrations"] if c["shape"] == shape_name), None)
    if calibration is None:
        raise ValueError(f"calibrations: the report has none for {shape_name!r}")
    profile = Profile.from_dict({**report["profile"], "overheads": calibration["overheads"]})
    host = calibration.get("host") or None
    if host is None:
        return profile, None
    return profile, SimConfig(
        host_cores=host["cores"],
        host_background_cores=host["background_cores"],
        host_stream_cpu_per_step_s=host["stream_cpu_per_step_ms"] / 1e3,
        host_stream_cpu_per_token_s=host["stream_cpu_per_token_ms"] / 1e3,
        host_stream_interference=host["stream_interference"],
        host_prefill_interference=host.get("prefill_interference", 1.0),
        host_handoff_cores=host.get("handoff_cores", 0.0),
    )
