"""The workload registry: `--workload NAME` -> its spec, built from the parsed CLI flags.

Each workload names the flags it accepts; a workload flag given to another workload is an error (a
silently ignored `--groups` would make a run measure something else than its author thinks). Flags a
workload accepts but that were not given take the defaults below.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from loadtest.config import WorkloadSpec
from loadtest.lengths import LengthDist
from loadtest.poisson import PoissonSpec
from loadtest.shared_prefix import SharedPrefixSpec
from loadtest.sharegpt import ShareGptSpec
from loadtest.trace import TraceSpec

DEFAULT_RATE_PER_S = 1.0
DEFAULTS = {
    "num_requests": 64,
    "prompt_len": "uniform:32,256",
    "output_len": "uniform:16,64",
    "groups": 4,
    "prompts_per_group": 8,
    "prefix_len": 256,
    "suffix_len": 32,
}


def _given(args: argparse.Namespace, name: str):
    value = getattr(args, name)
    return DEFAULTS[name] if value is None else value


def _dist(args: argparse.Namespace, name: str) -> LengthDist:
    try:
        return LengthDist.parse(_given(args, name))
    except ValueError as err:
        raise ValueError(f"--{name.replace('_', '-')}: {err}") from None


def _or(value, default):
    """`value or default` that keeps falsy values (0 must reach validation, not become the default)."""
    return default if value is None else value


def _poisson(args: argparse.Namespace) -> PoissonSpec:
    return PoissonSpec(
        _given(args, "num_requests"),
        _or(args.rate, DEFAULT_RATE_PER_S),
        _dist(args, "prompt_len"),
        _dist(args, "output_len"),
    )


def _shared_prefix(args: argparse.Namespace) -> SharedPrefixSpec:
    return SharedPrefixSpec(
        _given(args, "groups"),
        _given(args, "prompts_per_group"),
        _given(args, "prefix_len"),
        _given(args, "suffix_len"),
        _dist(args, "output_len"),
        _or(args.rate, DEFAULT_RATE_PER_S),
        args.num_requests,
    )


def _trace(args: argparse.Namespace) -> TraceSpec:
    if args.trace is None:
        raise ValueError("--workload trace needs --trace FILE (a Mooncake .jsonl or an Azure .csv trace)")
    if args.trace_speedup is not None and (args.rate is not None or args.sweep is not None):
        raise ValueError("--trace-speedup cannot be combined with --rate or --sweep (they set the speed-up)")
    return TraceSpec(
        args.trace,
        _or(args.trace_format, "auto"),
        _or(args.trace_speedup, 1.0),
        args.rate,
        args.trace_prompt_scale,
        _or(args.trace_output_scale, 1.0),
        _or(args.trace_overflow, "drop"),
        _or(args.trace_spread_s, 0.0),
        args.num_requests,
    )


def _sharegpt(args: argparse.Namespace) -> ShareGptSpec:
    if args.dataset is None:
        raise ValueError("--workload sharegpt needs --dataset FILE (a ShareGPT-style JSON list of conversations)")
    return ShareGptSpec(args.dataset, _or(args.rate, DEFAULT_RATE_PER_S), args.num_requests)


_TRACE_FLAGS = (
    "trace",
    "trace_format",
    "trace_speedup",
    "trace_prompt_scale",
    "trace_output_scale",
    "trace_overflow",
    "trace_spread_s",
)
# name -> (spec builder, workload-specific flags it accepts)
WORKLOADS: dict[str, tuple[Callable[[argparse.Namespace], WorkloadSpec], tuple[str, ...]]] = {
    "poisson": (_poisson, ("rate", "num_requests", "prompt_len", "output_len")),
    "shared-prefix": (
        _shared_prefix,
        ("rate", "num_requests", "groups", "prompts_per_group", "prefix_len", "suffix_len", "output_len"),
    ),
    "trace": (_trace, ("rate", "num_requests", *_TRACE_FLAGS)),
    "sharegpt": (_sharegpt, ("rate", "num_requests", "dataset")),
}
WORKLOAD_FLAGS = tuple(dict.fromkeys(flag for _, flags in WORKLOADS.values() for flag in flags))


def spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    """The spec of `args.workload`; ValueError naming a misplaced or bad flag, or an unknown workload."""
    if args.workload not in WORKLOADS:
        raise ValueError(f"unknown --workload {args.workload!r}; known: {', '.join(WORKLOADS)}")
    build, accepted = WORKLOADS[args.workload]
    for flag in WORKLOAD_FLAGS:
        if flag not in accepted and getattr(args, flag) is not None:
            owners = [name for name, (_, flags) in WORKLOADS.items() if flag in flags]
            raise ValueError(
                f"--{flag.replace('_', '-')} applies to --workload {' / '.join(owners)}, not {args.workload}"
            )
    return build(args)
