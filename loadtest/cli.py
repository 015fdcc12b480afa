"""`splitserve bench`: load-test a running router (see `loadtest` for the pieces, `summary` for what the
figures mean).

    splitserve bench --target 127.0.0.1:50051 --workload poisson --rate 2 --num-requests 100 \\
        --ttft-ms 2000 --tpot-ms 200 --out bench-out --plot bench-out/plots
    splitserve bench --backend openai --target http://127.0.0.1:8000 --rate 2 --num-requests 100
    splitserve bench --workload shared-prefix --groups 8 --prompts-per-group 16 --prefix-len 512 --sweep 1,2,4
    splitserve bench --workload trace --trace conversation_trace.jsonl --rate 2 --duration-s 300
    splitserve bench --backend openai-chat --chat-format tools --rate 2 --num-requests 50
    splitserve bench --backend openai-chat --workload sharegpt --dataset sharegpt.json --rate 2

Exit status: 0 after a run (whatever the server answered), 2 on a bad flag, 1 when the server cannot
be reached or the workload cannot be built for the served model.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid

from loadtest.chat_formats import CHAT_FORMATS
from loadtest.config import DEFAULT_TARGETS, BenchConfig, check_target, parse_rates
from loadtest.driver import DriverConfig
from loadtest.plan import RequestDefaults, Slo
from loadtest.runner import BenchError, run_bench
from loadtest.trace import OVERFLOW_POLICIES
from loadtest.trace_rows import FORMATS
from loadtest.workloads import DEFAULTS, WORKLOADS, spec_from_args
from splitserve_client.channel import ClientTls
from splitserve_client.cli_args import add_connection_flags


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    # Workload flags default to None so that "given to the wrong workload" can be told (workloads.py).
    g = parser.add_argument_group("workload (defaults apply to the workloads that take the flag)")
    g.add_argument("--workload", default="poisson", choices=tuple(WORKLOADS), help="default poisson")
    g.add_argument("--dataset", help="sharegpt: a ShareGPT-style JSON list of conversations")
    g.add_argument(
        "--rate",
        type=float,
        help="request rate in req/s, 'inf' = all at once (default 1; trace: the mean rate to rescale the trace to)",
    )
    g.add_argument(
        "--num-requests",
        type=int,
        help=f"requests to plan (poisson default {DEFAULTS['num_requests']}; "
        "shared-prefix: all groups x prompts; trace: every row that fits)",
    )
    g.add_argument(
        "--prompt-len",
        help="poisson prompt tokens: fixed:N | uniform:LO,HI | lognormal:MEAN,SIGMA "
        f"(default {DEFAULTS['prompt_len']})",
    )
    g.add_argument("--output-len", help=f"output tokens, same forms (default {DEFAULTS['output_len']})")
    g.add_argument("--groups", type=int, help=f"shared-prefix groups (default {DEFAULTS['groups']})")
    g.add_argument("--prompts-per-group", type=int, help=f"default {DEFAULTS['prompts_per_group']}")
    g.add_argument("--prefix-len", type=int, help=f"shared prefix tokens (default {DEFAULTS['prefix_len']})")
    g.add_argument("--suffix-len", type=int, help=f"unique suffix tokens (default {DEFAULTS['suffix_len']})")
    g.add_argument("--trace", metavar="FILE", help="Mooncake .jsonl or Azure .csv trace to replay")
    g.add_argument("--trace-format", choices=("auto", *FORMATS), help="default auto (from the content)")
    g.add_argument("--trace-speedup", type=float, help="divide trace times by this (default 1)")
    g.add_argument(
        "--trace-prompt-scale",
        type=float,
        help="multiply prompt lengths (default: Mooncake block_size/512, one KV block per trace block; Azure 1)",
    )
    g.add_argument("--trace-output-scale", type=float, help="multiply output lengths (default 1)")
    g.add_argument("--trace-overflow", choices=OVERFLOW_POLICIES, help="rows over max_model_len (default drop)")
    g.add_argument(
        "--trace-spread-s",
        type=float,
        help="spread arrivals uniformly over this window "
        "(Mooncake conversation: 3 smooths its 3 s buckets; default 0 = as recorded)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve bench",
        description="Load-test a running splitserve "
        "router over gRPC, or any OpenAI-compatible server over HTTP: open-loop "
        "arrivals, latency, SLO attainment, goodput.",
        epilog=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backend",
        default="splitserve",
        choices=tuple(DEFAULT_TARGETS),
        help="splitserve (gRPC), openai (HTTP /v1/completions) or openai-chat (HTTP /v1/chat/completions) "
        "(default %(default)s)",
    )
    add_connection_flags(parser)  # --target, --auth-token-file, --tls-*: as every client command
    parser.set_defaults(target=None)  # the default depends on --backend
    next(a for a in parser._actions if a.dest == "target").help = (
        "splitserve: HOST:PORT, [V6]:PORT, unix:PATH or a gRPC URI (default 127.0.0.1:50051); "
        "openai: http(s)://HOST:PORT (default http://127.0.0.1:8000)"
    )
    parser.add_argument("--model", help="openai: the served model to ask for (default: the first it lists)")
    parser.add_argument(
        "--chat-format",
        choices=tuple(CHAT_FORMATS),
        help="openai-chat: plain text, tools (tool_choice required) or json-schema (response_format) (default plain)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="openai: the model's tokenizer folder, for servers "
        "whose /v1/models does not state the vocabulary (splitserve's does)",
    )
    add_workload_flags(parser)
    run = parser.add_argument_group("run")
    run.add_argument("--duration-s", type=float, help="stop issuing after this many seconds")
    run.add_argument(
        "--grace-s",
        type=float,
        default=10.0,
        help="after --duration-s, wait this long, then cancel what is still running (default %(default)s)",
    )
    run.add_argument("--max-concurrency", type=int, default=64, help="open streams at most (default %(default)s)")
    run.add_argument("--request-timeout-s", type=float, default=600.0, help="per request (default %(default)s)")
    run.add_argument("--ttft-ms", type=float, help="TTFT SLO sent with every request (default: router's)")
    run.add_argument("--tpot-ms", type=float, help="TPOT SLO sent with every request (default: router's)")
    run.add_argument("--priority", type=int, default=0, help="in [-1000, 1000] (default 0)")
    run.add_argument("--tenant", default="", help="tenant name (default none)")
    run.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy); EOS is always ignored")
    run.add_argument("--seed", type=int, default=0, help="seeds arrivals, lengths and tokens (default 0)")
    run.add_argument("--warmup-s", type=float, default=0.0, help="requests due before this are not measured")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    report = parser.add_argument_group("report")
    report.add_argument("--out", metavar="DIR", help="write records.jsonl and summary.json here")
    report.add_argument("--plot", metavar="DIR", help="write latency CDF PNGs (and sweep plots) here")
    report.add_argument("--sweep", metavar="RATES", help="run once per rate, e.g. 1,2,4 (replaces --rate)")
    report.add_argument(
        "--attainment-target",
        type=float,
        default=0.9,
        help="SLO attainment a sweep's best rate must keep (default %(default)s)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """ValueError naming the flag on any bad or conflicting value."""
    target = args.target or DEFAULT_TARGETS[args.backend]
    check_target(target, args.backend)
    if args.sweep is not None and args.rate is not None:
        raise ValueError("--sweep sets the rate of each run: drop --rate")
    sweep = parse_rates(args.sweep) if args.sweep is not None else ()
    driver = DriverConfig(
        args.max_concurrency,
        args.duration_s,
        args.grace_s,
        args.request_timeout_s,
        args.temperature,
        f"bench-{uuid.uuid4().hex[:8]}",
        not args.no_progress,
    )
    defaults = RequestDefaults(Slo(args.ttft_ms, args.tpot_ms), args.priority, args.tenant)
    tls = ClientTls.from_files(
        args.tls_ca_file, args.tls_cert_file, args.tls_key_file, args.tls_server_name, enabled=args.tls
    )
    return BenchConfig(
        target,
        args.workload,
        spec_from_args(args),
        driver,
        defaults,
        args.seed,
        args.auth_token_file,
        args.out,
        args.plot,
        sweep,
        args.attainment_target,
        args.warmup_s,
        args.backend,
        args.model,
        args.tokenizer,
        tls,
        args.chat_format,
    )


def parse_config(argv: list[str]) -> BenchConfig:
    """The validated config; exits with status 2 and the usage line on a bad flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return config_from_args(args)
    except ValueError as err:
        parser.error(str(err))


def main(argv: list[str] | None = None) -> None:
    config = parse_config(sys.argv[1:] if argv is None else argv)
    try:
        asyncio.run(run_bench(config))
    except BenchError as err:
        sys.exit(f"splitserve bench: {err}")
