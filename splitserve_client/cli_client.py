"""Client-side commands: `splitserve generate`, `splitserve status`, `splitserve health`.

They use only the SDK (grpcio + protobuf), so they start fast and run anywhere a router is reachable.
"""

from __future__ import annotations

import argparse
import json
import sys


def _common(prog: str, description: str, timeout_s: float = 600.0) -> argparse.ArgumentParser:
    from splitserve_client.cli_args import add_connection_flags

    p = argparse.ArgumentParser(prog=prog, description=description)
    add_connection_flags(p)
    p.add_argument("--timeout-s", type=float, default=timeout_s, help="give up after this long (default %(default)s)")
    return p


def _parse(p: argparse.ArgumentParser, argv: list[str]):
    """(args, Connection); a bad connection flag exits with the usage line, naming it."""
    from splitserve_client.cli_args import connection_from_args

    args = p.parse_args(argv)
    try:
        return args, connection_from_args(args)
    except ValueError as err:
        p.error(str(err))


def _client(connection, timeout_s: float):
    from splitserve_client.client import Client

    return Client(connection.target, timeout_s=timeout_s, **connection.client_kwargs())


def generate_main(argv: list[str]) -> None:
    p = _common("splitserve generate", "Stream a completion to the terminal.")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--tenant")
    p.add_argument("--usage", action="store_true", help="print token counts and the route at the end")
    args, connection = _parse(p, argv)
    from splitserve_client.sdk_types import SplitserveError

    with _client(connection, args.timeout_s) as client:
        try:
            route = usage = None
            for chunk in client.generate_stream(
                args.prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                stop=args.stop,
                ignore_eos=args.ignore_eos,
                tenant=args.tenant,
            ):
                print(chunk.text, end="", flush=True)
                route, usage = route or chunk.route, usage or chunk.usage
            print()
            if args.usage and usage is not None and route is not None:
                print(
                    f"[{usage.completion_tokens} tokens, {usage.cached_prompt_tokens}/{usage.prompt_tokens} prompt "
                    f"tokens cached, prefill {route.prefill_worker}, decode {route.decode_instance}]"
                )
        except SplitserveError as err:
            sys.exit(f"splitserve generate: {err}" + (f" (field {err.field})" if err.field else ""))


def status_main(argv: list[str]) -> None:
    args, connection = _parse(_common("splitserve status", "Show the cluster's workers, load and cache figures."), argv)
    from splitserve_client.sdk_types import SplitserveError

    with _client(connection, args.timeout_s) as client:
        try:
            info, status = client.model_info(), client.status()
        except SplitserveError as err:
            sys.exit(f"splitserve status: {err}")
    print(
        f"model {info.model_identity}  max_model_len {info.max_model_len}  block_size {info.block_size}  "
        f"policy {status.routing_policy}  in flight {status.inflight_requests}"
    )
    print(
        f"{'worker':<28} {'role':<8} {'state':<9} {'epoch':>5} {'restarts':>8} {'healthy':<8} {'inflight':>8} "
        f"{'waiting':>8} {'running':>8} {'kv use':>7}"
    )
    for w in status.workers:
        print(
            f"{w['worker_id']:<28} {w['role']:<8} {w['state']:<9} {w['epoch']:>5} {w['restarts']:>8} "
            f"{w['healthy']!s:<8} {w['inflight_requests']:>8} {w['waiting']:>8} {w['running']:>8} "
            f"{w['kv_usage']:>6.1%}"
        )
        for tier in w.get("kv_tiers", ()):
            print(f"  kv tier {_tier_line(tier)}")
    hit = status.cached_prompt_tokens_total / max(status.prompt_tokens_total, 1)
    print(
        f"prefix hit rate {hit:.1%} ({status.cached_prompt_tokens_total}/{status.prompt_tokens_total} prompt "
        f"tokens), index entries {status.index_entries}, requests {json.dumps(status.requests_total)}"
    )


def _tier_line(tier: dict) -> str:
    """One KV tier of a worker: its size (a shared store's is its own) and hit rate since the worker started."""
    lookups = tier["hits"] + tier["misses"]
    rate = f"{tier['hits'] / lookups:.1%}" if lookups else "-"
    size = (
        f"{tier['used_bytes'] / 2**20:.1f}/{tier['capacity_bytes'] / 2**20:.1f} MiB" if tier["capacity_bytes"] else "-"
    )
    return f"{tier['tier']:<6} size {size:<20} hits {tier['hits']}/{lookups} ({rate})"


def health_main(argv: list[str]) -> None:
    """Exit 0 iff the router's standard gRPC health service says SERVING (Docker HEALTHCHECK, helm test)."""
    args, connection = _parse(_common("splitserve health", health_main.__doc__ or "", timeout_s=3.0), argv)
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve_client.channel import connection_hint, open_channel

    with open_channel(connection.target, connection.tls) as channel:
        try:
            # types-grpcio-health-checking's HealthStub declares no methods; the generated class has Check.
            check = health_pb2_grpc.HealthStub(channel).Check  # type: ignore[attr-defined]
            reply = check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout_s)
        except grpc.RpcError as err:
            hint = connection_hint(err.details() or "", connection.tls)
            sys.exit(f"splitserve health: {connection.target}: {err.code().name}" + (f" ({hint})" if hint else ""))
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    sys.exit(0 if serving else 1)
