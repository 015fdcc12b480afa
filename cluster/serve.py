"""`splitserve serve`: start (or join) Ray, launch the worker pools, serve the gRPC router.

Configuration comes from one place: an optional YAML file (`--config`, the same schema the Helm chart
renders) with flags layered on top, all validated by `ClusterConfig.from_dict`. No `--model` means
the generated demo checkpoint; no `--redis-url` means the router's in-process prefix index.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from cluster.config import ClusterConfig, ConfigError

# flag → (section, key) in the config mapping; None section = top level
_FLAG_KEYS = {"model": (None, "model_dir"), "block_size": (None, "block_size"), "redis_url": (None, "redis_url"),
              "ray_address": (None, "ray_address"),
              "rendezvous_host": (None, "rendezvous_host"), "prefill": ("prefill", "replicas"),
              "decode": ("decode", "replicas"), "tp": ("decode", "tp_size"), "host": ("router", "host"),
              "port": ("router", "port"), "policy": ("router", "policy"),
              "auth_token_file": ("router", "auth_token_file"), "metrics_port": ("router", "metrics_port"),
              "kv_cache_dtype": (None, "kv_cache_dtype"), "quantization": (None, "quantization")}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, help="YAML cluster config (flags override it)")
    p.add_argument("--model", help="HF checkpoint directory (default: the demo model)")
    p.add_argument("--prefill", type=int, help="prefill workers")
    p.add_argument("--decode", type=int, help="decode instances")
    p.add_argument("--tp", type=int, help="tensor-parallel ranks per decode instance")
    p.add_argument("--block-size", type=int, help="tokens per KV block")
    p.add_argument("--kv-cache-dtype", help="KV cache storage: auto (the model dtype), int8 or fp8")
    p.add_argument("--quantization", help="weight quantization: none or int8 (weight-only, per output channel)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gRPC port (default 50051; 0 = any free port)")
    p.add_argument("--uds", help="also serve on this unix socket path (reachable from outside a network sandbox)")
    p.add_argument("--redis-url", help="Redis for the global prefix index (default: in-process index)")
    p.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    p.add_argument("--rendezvous-host", help="address workers use to reach this process (default 127.0.0.1)")
    p.add_argument("--policy", help="routing policy: round_robin, prefix_hash or cache_aware")
    p.add_argument("--auth-token-file", help="require this bearer token from clients")
    p.add_argument("--metrics-port", type=int, help="Prometheus metrics port")
    return p


def build_config(args: argparse.Namespace) -> ClusterConfig:
    """The YAML file (if any) with the flags that were given layered on top, validated once."""
    raw: dict = {}
    if args.config is not None:
        import yaml

        try:
            raw = yaml.safe_load(args.config.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"--config {args.config}: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"--config {args.config}: must hold a mapping, got {type(raw).__name__}")
    for flag, (section, key) in _FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is not None:
            target = raw if section is None else raw.setdefault(section, {})
            target[key] = value
    return ClusterConfig.from_dict(raw)


async def serve(config: ClusterConfig, uds: str | None = None) -> None:
    """Runs until SIGINT or SIGTERM, then drains streams in flight and stops the workers."""
    from cluster.launcher import launch
    from router.server import RouterServer

    loop = asyncio.get_running_loop()
    cluster = await loop.run_in_executor(None, launch, config, None)
    server = None
    try:
        server = await RouterServer.start(cluster, config, extra_addresses=[f"unix:{uds}"] if uds else [])
        _announce(server, config, uds)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("splitserve: shutting down (streams in flight get 5 s)", flush=True)
    finally:
        if server is not None:
            await server.stop()
        cluster.shutdown()


def _announce(server, config: ClusterConfig, uds: str | None) -> None:
    target = f"unix:{uds}" if uds else server.address
    auth = f" --auth-token-file {config.router.auth_token_file}" if config.router.auth_token_file else ""
    print(f"splitserve: router listening on {server.address}" + (f" and unix:{uds}" if uds else ""), flush=True)
    print(f"splitserve: {len(server.service.cluster.prefill)} prefill worker(s), "
          f"{len(server.service.cluster.decode)} decode instance(s) x {config.decode.tp_size} rank(s), "
          f"policy {config.router.policy}, model {server.service.info.model_identity}", flush=True)
    print(f"try:  splitserve generate --target {target}{auth} --max-tokens 32 \"Once upon a time\"", flush=True)


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    try:
        config = build_config(args)
    except ConfigError as err:
        sys.exit(f"splitserve serve: {err}")
    asyncio.run(serve(config, args.uds))
