"""Flags `splitserve simulate` and `splitserve plan` share: the profile, the workload (the bench's own
flags, `loadtest.cli`), the SLO, and what each worker and the router are configured with (the
router's routing and admission policies, by their registry names).

`--cache-block-tokens auto` keys the prefix cache on a Mooncake trace's own blocks (512 tokens times
the prompt scale: finer blocks would hold no more information and cost more bookkeeping), else on
the model's KV block size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from common.admission_config import AdmissionConfig
from loadtest.cli import add_workload_flags
from loadtest.sim_workload import limits_of, repeat_trace, sim_requests
from loadtest.trace import TraceSpec
from loadtest.trace_rows import MOONCAKE_BLOCK_TOKENS
from loadtest.workloads import spec_from_args
from sim.config import ADMISSIONS, POLICIES, SimConfig
from sim.profile import Profile
from sim.worker import EngineLimits


def add_sim_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, metavar="FILE", help="a profile written by splitserve profile")
    add_workload_flags(parser)
    parser.set_defaults(sweep=None)
    g = parser.add_argument_group("simulated cluster")
    g.add_argument("--ttft-ms", type=float, help="TTFT SLO every request is judged against")
    g.add_argument("--tpot-ms", type=float, help="TPOT SLO every request is judged against")
    g.add_argument("--seed", type=int, default=0, help="workload seed, as splitserve bench's (default 0)")
    g.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="tile the workload N times in time, each copy with "
        "prefixes of its own (a synthetic longer trace; default 1)",
    )
    g.add_argument("--policy", choices=POLICIES, default="cache_aware")
    g.add_argument(
        "--admission",
        choices=ADMISSIONS,
        default="always",
        help="the router's admission policy (policies.admission; default always)",
    )
    g.add_argument(
        "--admission-config",
        metavar="FILE",
        help="a JSON file with the admission section's settings (common/admission_config.py); "
        "its policy, if given, must be --admission's",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        help="the client's open streams at most (bench default 64; default here: unlimited)",
    )
    g.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router processes sharing the traffic (default 1; plan's fleet: one for each copy of the shape)",
    )
    g.add_argument(
        "--router-max-requests", type=int, default=1024, help="each router's max_concurrent_requests (default 1024)"
    )
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--prefill-chunk-tokens", type=int, default=512)
    g.add_argument("--prefill-kv-tokens", type=int, help="KV tokens per prefill worker (default: the profile's)")
    g.add_argument("--decode-kv-tokens", type=int, help="KV tokens per decode instance (default: the profile's)")
    g.add_argument("--cache-block-tokens", default="auto", help="prefix-cache block size in tokens (default auto)")
    g.add_argument("--no-prefix-caching", action="store_true")


def load_inputs(args: argparse.Namespace) -> tuple[Profile, list, dict, SimConfig]:
    """(profile, requests, the workload's notes, a 1P1D config carrying every shared setting);
    ValueError naming the flag on a bad value."""
    profile = Profile.load(args.profile)
    spec = spec_from_args(args)
    limits = limits_of(profile)
    block_tokens = _cache_block_tokens(args.cache_block_tokens, spec, profile)
    requests, notes = sim_requests(spec, limits, block_tokens, args.seed)
    if args.repeat != 1:
        requests = repeat_trace(requests, args.repeat)
        notes["repeat"] = f"{args.repeat} copies in time, each with its own prefixes (synthetic scale-up)"
    base = SimConfig(
        limits=EngineLimits(args.max_num_seqs, args.max_num_batched_tokens, args.prefill_chunk_tokens),
        prefill_kv_tokens=args.prefill_kv_tokens,
        decode_kv_tokens=args.decode_kv_tokens,
        cache_block_tokens=block_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        policy=args.policy,
        admission=args.admission,
        admission_config=_admission_config(args.admission, args.admission_config),
        ttft_slo_s=None if args.ttft_ms is None else args.ttft_ms / 1e3,
        tpot_slo_s=None if args.tpot_ms is None else args.tpot_ms / 1e3,
        max_concurrency=args.max_concurrency,
        router_max_requests=args.router_max_requests,
        routers=args.routers,
    )
    return profile, requests, notes, base


def with_pools(base: SimConfig, prefill: int, decode: int, tp: int = 1, colocated: int = 0) -> SimConfig:
    return dataclasses.replace(base, prefill=prefill, decode=decode, tp=tp, colocated=colocated)


def _admission_config(policy: str, path: str | None) -> AdmissionConfig | None:
    if path is None:
        return None
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"--admission-config {path}: must hold a JSON object")
    return AdmissionConfig.from_dict({"policy": policy, **raw})


def _cache_block_tokens(text: str, spec, profile: Profile) -> int:
    block = profile.model.block_size
    if text != "auto":
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"--cache-block-tokens must be auto or a whole number, got {text!r}") from None
        if value < 1:
            raise ValueError(f"--cache-block-tokens must be >= 1, got {value}")
        return value
    if isinstance(spec, TraceSpec) and spec.prompt_scale is not None:
        trace_block = round(spec.prompt_scale * MOONCAKE_BLOCK_TOKENS)
        if trace_block >= block and trace_block % block == 0:
            return trace_block
    return block
