"""Entry points: `splitserve serve`, `splitserve controller`, `splitserve router`.

- `serve [pool flags]`: starts the cluster's controller if none runs for `--cluster-name` in the Ray
  cluster it joins (or starts), then serves one router (one command on a laptop).
- `controller --ray-address ADDR [pool flags]`: starts only the controller; returns once the pools
  serve. The controller and its workers live in the Ray cluster, not in this process.
- `router --ray-address ADDR [--port P] [--http-port P]`: one more router against a running controller;
  fails within seconds when there is none.
Every router serves gRPC on `--port` and the OpenAI-compatible HTTP API on `--http-port` (8000 unless
given; `--http-port 0` turns it off), both on `--host`, plus unix sockets with `--uds` / `--http-uds`.
A port that is taken (another router's, say) fails the start at once with one line naming its flag.
Any of them joining a running cluster fails naming every pool/model key it was given that disagrees
with the running config. A process that joined an existing Ray cluster (`--ray-address`) leaves the
pools serving when it stops (a router pod's eviction must not take the workers); one that started
its own local Ray takes everything down with it.

Flags vLLM's `vllm serve` shares mean the same here, except `--port`: gRPC here (vLLM's `--port`, the
OpenAI API, is `--http-port`). A vLLM flag this server has no equivalent for is refused, naming it.

Configuration comes from one place: an optional YAML file (`--config`, the same schema the Helm chart
renders) with flags layered on top, all validated by `ClusterConfig.from_dict`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from common.config import ROUTING_POLICIES, ClusterConfig, ConfigError
from common.logs import FORMATS, LEVELS, configure_logging, export_logging
from common.ports import CannotListen, PortInUse, check_router_ports
from common.router_config import API_KEY_ENV, REASONING_PARSERS, TOOL_CALL_PARSERS
from engine.kv_quant import KV_CACHE_DTYPES
from engine.layers.quantization import QUANTIZATIONS
from engine.model_source import resolve_model

DEFAULT_CLUSTER_NAME = "default"
# flag → (section, key) in the config mapping; None section = top level
_POOL_FLAGS = {
    "model": (None, "model_dir"),
    "revision": (None, "model_revision"),
    "served_model_name": (None, "served_model_name"),
    "max_model_len": (None, "max_model_len"),
    "block_size": (None, "block_size"),
    "redis_url": (None, "redis_url"),
    "rendezvous_host": (None, "rendezvous_host"),
    "prefill": ("prefill", "replicas"),
    "decode": ("decode", "replicas"),
    "tp": ("decode", "tp_size"),
    "kv_cache_dtype": (None, "kv_cache_dtype"),
    "quantization": (None, "quantization"),
    "quantization_group_size": (None, "quantization_group_size"),
}
_ROUTER_FLAGS = {
    "host": ("router", "host"),
    "port": ("router", "port"),
    "policy": ("router", "policy"),
    "auth_token_file": ("router", "auth_token_file"),
    "metrics_port": ("router", "metrics_port"),
    "tls_cert_file": ("router", "tls_cert_file"),
    "tls_key_file": ("router", "tls_key_file"),
    "tls_client_ca_file": ("router", "tls_client_ca_file"),
    "health_port": ("router", "health_port"),
    "tool_call_parser": ("router", "tool_call_parser"),
    "reasoning_parser": ("router", "reasoning_parser"),
    "chat_template": ("router", "chat_template"),
    "trust_request_chat_template": ("router", "trust_request_chat_template"),
}
# vLLM serve flags with no equivalent here → what to do instead; given one, the start fails naming it
# (argparse's own refusal of an unknown flag would not say it is vLLM's).
VLLM_ONLY_FLAGS = {
    "--gpu-memory-utilization": "KV memory is set per pool (kv_cache_memory_bytes in --config)",
    "--tensor-parallel-size": "use --tp (decode ranks)",
    "--pipeline-parallel-size": "pipeline parallelism is not supported",
    "--max-num-seqs": "set prefill/decode max_num_seqs in --config",
    "--trust-remote-code": "only architectures the engine implements are served",
    "--dtype": "the checkpoint's dtype is served",
    "--enforce-eager": "not applicable",
    "--disable-log-requests": "use --log-level",
    "--lora-modules": "LoRA is not supported",
}
_COMMON_FLAGS = {
    "ray_address": (None, "ray_address"),
    "cluster_name": (None, "cluster_name"),
    "otlp_traces_endpoint": (None, "otlp_traces_endpoint"),
}
# the router's listening ports: config key → the flag that sets it
_PORT_FLAGS = {
    "router.port": "--port",
    "router.http_port": "--http-port",
    "router.health_port": "--health-port",
    "router.metrics_port": "--metrics-port",
}


def _one_of(names) -> str:
    return ", ".join(names)


def parser(prog: str, *, pools: bool = True, router: bool = True, need_ray: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, help="YAML cluster config (flags override it)")
    p.add_argument(
        "--ray-address",
        required=need_ray,
        help="join this Ray cluster" + ("" if need_ray else " (default: start a local one)"),
    )
    p.add_argument("--cluster-name", help=f"which cluster in the Ray cluster (default {DEFAULT_CLUSTER_NAME})")
    p.add_argument("--log-level", choices=LEVELS, default="info", help="log lines at this level and above")
    p.add_argument("--log-format", choices=FORMATS, default="text", help="text lines, or one JSON object a line")
    p.add_argument(
        "--otlp-traces-endpoint",
        help="export request traces to this OpenTelemetry collector (OTLP/gRPC, e.g. http://collector:4317)",
    )
    if pools:
        p.add_argument(
            "--model", help="HF checkpoint folder, or a Hub id ORG/NAME in the local HF cache (default: the demo model)"
        )
        p.add_argument("--revision", help="the Hub id's branch, tag or commit (default main)")
        p.add_argument(
            "--served-model-name",
            nargs="+",
            metavar="NAME",
            help="names /v1/models lists and requests may use (default: the Hub id, or the folder's name and path)",
        )
        p.add_argument("--max-model-len", type=int, help="longest sequence served (default: the model's limit)")
        p.add_argument("--prefill", type=int, help="prefill workers")
        p.add_argument("--decode", type=int, help="decode instances")
        p.add_argument("--tp", type=int, help="tensor-parallel ranks per decode instance")
        p.add_argument("--block-size", type=int, help="tokens per KV block")
        # The values come from the registries the config validates against (the one check, in the config:
        # its error names the key): a new format needs no edit here.
        p.add_argument("--kv-cache-dtype", help=f"KV cache storage: {_one_of(KV_CACHE_DTYPES)} (auto: the model dtype)")
        p.add_argument("--quantization", help=f"weight quantization: {_one_of(QUANTIZATIONS)} (int8: weight-only)")
        p.add_argument(
            "--quantization-group-size",
            type=int,
            help="input features per weight scale group when quantizing at load (default: int8 per channel, int4 128)",
        )
        p.add_argument("--redis-url", help="Redis for the global prefix index (default: in-process index)")
        p.add_argument(
            "--rendezvous-host", help="address workers use to reach the rendezvous store (default: its node's IP)"
        )
    if router:
        p.add_argument("--host", help="address to bind (default 127.0.0.1)")
        p.add_argument(
            "--port",
            type=int,
            help="gRPC port (default 50051; 0 = any free port). Unlike vLLM's --port, not the OpenAI API: "
            "that is --http-port",
        )
        p.add_argument(
            "--uds", help="also serve gRPC on this unix socket path (reachable from outside a network sandbox)"
        )
        p.add_argument("--http-port", type=int, help="OpenAI-compatible HTTP port (default 8000; 0 turns it off)")
        p.add_argument("--http-uds", help="also serve the HTTP API on this unix socket path")
        p.add_argument("--policy", help=f"routing policy: {_one_of(ROUTING_POLICIES)} (default cache_aware)")
        p.add_argument("--auth-token-file", help="require the bearer token in this file from clients")
        p.add_argument(
            "--api-key",
            help=f"require this bearer token from clients, as vLLM's --api-key (or set {API_KEY_ENV}; "
            "not with --auth-token-file)",
        )
        p.add_argument(
            "--tool-call-parser",
            help=f"find tool calls in chat output (tool_choice auto), with vLLM's parser of that name: "
            f"{_one_of(TOOL_CALL_PARSERS)} (the format each reads: docs/api.md)",
        )
        p.add_argument(
            "--enable-auto-tool-choice",
            action="store_true",
            help="accepted as vLLM takes it; tool_choice auto is on whenever --tool-call-parser is given",
        )
        p.add_argument(
            "--reasoning-parser", help=f"split thinking into reasoning_content: {_one_of(REASONING_PARSERS)}"
        )
        p.add_argument("--chat-template", help="a Jinja chat template file used instead of the checkpoint's")
        p.add_argument(
            "--trust-request-chat-template",
            action="store_true",
            default=None,
            help="accept a request's own chat_template (Jinja run on the router: trusted clients only)",
        )
        p.add_argument("--metrics-port", type=int, help="Prometheus metrics port")
        p.add_argument("--tls-cert-file", help="serve TLS with this PEM certificate chain (needs --tls-key-file)")
        p.add_argument("--tls-key-file", help="PEM private key of --tls-cert-file")
        p.add_argument("--tls-client-ca-file", help="require client certificates signed by this PEM CA (mutual TLS)")
        p.add_argument("--health-port", type=int, help="plaintext port serving only gRPC health (probes without TLS)")
    return p


def build_config(args: argparse.Namespace) -> tuple[ClusterConfig, dict]:
    """The YAML file (if any) with the flags that were given layered on top, validated once; and the
    plain data that was given (checked against a running cluster's config when joining it)."""
    raw: dict = {}
    if args.config is not None:
        import yaml

        try:
            raw = yaml.safe_load(args.config.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"--config {args.config}: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"--config {args.config}: must hold a mapping, got {type(raw).__name__}")
    for flag, (section, key) in {**_POOL_FLAGS, **_ROUTER_FLAGS, **_COMMON_FLAGS}.items():
        value = getattr(args, flag, None)
        if value is not None:
            target = raw if section is None else raw.setdefault(section, {})
            target[key] = value
    if getattr(args, "http_port", None) is not None:  # on the command line 0 means off (in a config file: null)
        raw.setdefault("router", {})["http_port"] = args.http_port or None
    raw.setdefault("cluster_name", DEFAULT_CLUSTER_NAME)
    ClusterConfig.from_dict(raw)  # types and values first: a bad key fails before any lookup
    _resolve_model(raw)
    return ClusterConfig.from_dict(raw), raw


def _resolve_model(raw: dict) -> None:
    """A Hub id becomes its cached snapshot folder, which every process of the cluster reads (a shared
    cache volume mounts at the same path everywhere), and, unless names were given, the name the
    OpenAI API serves it under."""
    model = raw.get("model_dir")
    if model is None:
        return
    folder = str(resolve_model(model, raw.get("model_revision")))
    if folder != model:
        raw["model_dir"] = folder
        raw.setdefault("served_model_name", [model])


async def serve(
    config: ClusterConfig, given: dict, uds: str | None = None, *, join_only: bool = False, http_uds: str | None = None
) -> None:
    """Starts or joins the cluster, serves one router until SIGINT or SIGTERM, then drains streams in flight."""
    from cluster.launcher import launch
    from engine.heap import freeze_startup_heap
    from router.server import RouterServer

    # A taken port fails before Ray starts or is joined: seconds, not a cluster start, and nothing to undo.
    check_router_ports(config.router)
    loop = asyncio.get_running_loop()
    launched = await loop.run_in_executor(
        None, lambda: launch(config, given=given, join_only=join_only, on_progress=_say)
    )
    # A shared Ray cluster keeps the pools (see top); a controller this process joined is never its to stop.
    launched.owns_controller = launched.owns_controller and config.ray_address is None
    server = None
    try:
        server = await RouterServer.start(
            launched, launched.config, extra_addresses=[f"unix:{uds}"] if uds else [], http_uds=http_uds
        )
        _announce(server, launched.config, uds)
        freeze_startup_heap()  # this process is ours: later full collections skip the startup heap
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        _say("shutting down (streams in flight get 5 s)")
    finally:
        if server is not None:
            await server.stop()
        launched.shutdown()


def _say(message: str) -> None:
    print(f"splitserve: {message}", flush=True)


def _announce(server, config: ClusterConfig, uds: str | None) -> None:
    target = f"unix:{uds}" if uds else server.address
    auth = f" --auth-token-file {config.router.auth_token_file}" if config.router.auth_token_file else ""
    auth += " --tls-ca-file CA.pem" if config.router.tls_cert_file else ""
    membership = server.service.cluster.membership
    _say(f"router listening on {server.address}" + (f" and unix:{uds}" if uds else ""))
    _say(
        f"cluster {config.cluster_name!r} ({membership.cluster_id}): {len(membership.prefill)} prefill worker(s), "
        f"{len(membership.decode)} decode instance(s) x {config.decode.tp_size} rank(s), "
        f"policy {config.router.policy}, model {server.service.info.model_identity}"
    )
    _say(f'try:  splitserve generate --target {target}{auth} --max-tokens 32 "Once upon a time"')
    http = server.http
    if http is not None:
        where = " and ".join(([http.url] if http.port else []) + ([f"unix:{http.uds}"] if http.uds else []))
        _say(f"OpenAI-compatible API on {where}")


def main(argv: list[str]) -> None:
    _run(parser("splitserve serve"), argv, join_only=False)


def router_main(argv: list[str]) -> None:
    _run(parser("splitserve router", need_ray=True), argv, join_only=True)


def controller_main(argv: list[str]) -> None:
    """Starts (or checks) the controller, waits for its pools, returns: they live on in the Ray cluster."""
    args = parser("splitserve controller", router=False, need_ray=True).parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    export_logging(args.log_level, args.log_format)  # the controller and workers log the same way
    from cluster.controller_slots import ClusterStartError
    from cluster.launcher import launch

    try:
        config, given = build_config(args)
        launched = launch(config, given=given, on_progress=_say)
    except (ConfigError, ClusterStartError) as err:
        sys.exit(f"splitserve controller: {err}")
    membership = launched.membership
    _say(
        f"cluster {config.cluster_name!r} ({membership.cluster_id}) serving: "
        f"{len(membership.prefill)} prefill worker(s), {len(membership.decode)} decode instance(s)"
    )


def refuse_vllm_flags(prog: str, argv: list[str]) -> None:
    """One line naming the first vLLM-only flag given, with what to use instead."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in VLLM_ONLY_FLAGS:
            sys.exit(f"{prog}: {flag} is vLLM's and not supported here: {VLLM_ONLY_FLAGS[flag]}")


def _run(p: argparse.ArgumentParser, argv: list[str], *, join_only: bool) -> None:
    refuse_vllm_flags(p.prog, argv)
    args = p.parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        sys.exit(f"{p.prog}: --enable-auto-tool-choice needs --tool-call-parser")
    if args.api_key is not None:  # read where the router starts, in this process, with the environment's
        os.environ[API_KEY_ENV] = args.api_key
    configure_logging(args.log_level, args.log_format)
    export_logging(args.log_level, args.log_format)  # the controller and workers log the same way
    from cluster.controller_slots import ClusterStartError
    from cluster.launcher import ClusterNotFound

    given: dict = {}
    try:
        config, given = build_config(args)
        asyncio.run(serve(config, given, args.uds, join_only=join_only, http_uds=args.http_uds))
    except (ConfigError, ClusterStartError, ClusterNotFound) as err:
        sys.exit(f"{p.prog}: {err}")
    except CannotListen as err:
        sys.exit(port_error_line(p.prog, err, args, given))


def port_error_line(prog: str, err: CannotListen, args: argparse.Namespace, given: dict) -> str:
    """One line for a port the router cannot listen on, naming what set it: the flag, or the config
    file's key when the file set it and no flag did (a default is changed with the flag)."""
    flag = _PORT_FLAGS.get(err.key)
    if flag is None:
        return f"{prog}: {err}"
    section, _, key = err.key.partition(".")
    from_flag = getattr(args, flag[2:].replace("-", "_"), None) is not None
    name = err.key if not from_flag and key in given.get(section, {}) else flag
    if not isinstance(err, PortInUse):
        return f"{prog}: {name} {err.port} cannot be bound on {err.host}: {err.reason}"
    # On the command line --http-port 0 turns the HTTP API off; everywhere else 0 asks for any free port.
    hint = "0 to turn the HTTP API off" if name == "--http-port" else "0 for any free one"
    return f"{prog}: {name} {err.port} is already in use on {err.host} (pick another port, or {hint})"
