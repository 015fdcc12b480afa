"""`router:` in the cluster config: where the router listens, how it routes, who may call it.

Checked with the rest of the cluster config: `ClusterConfig.__post_init__` calls `check_router`, and
errors name the key (`router.port: ...`).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config_parsing import check

ROUTING_POLICIES = ("round_robin", "least_loaded", "prefix_hash", "cache_aware")
# When the chosen prefill worker holds less of a prompt's prefix than another worker does, it can pull
# the difference from that holder: "auto" when the estimated transfer is faster than recomputing,
# "always" whenever there is a difference (benchmarks, tests), "never".
PREFIX_PULL_MODES = ("auto", "always", "never")
# The OpenAI front's output parsers, as vLLM names them (router/openai/tools.py and reasoning.py hold the
# registries; a test keeps these names equal to theirs).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "granite")
REASONING_PARSERS = ("deepseek_r1", "qwen3")
# The API key as vLLM takes it (`splitserve serve --api-key` sets it; the router reads it where it starts):
# the bearer token, like auth_token_file, kept out of the config so that it is not shared with the cluster.
API_KEY_ENV = "SPLITSERVE_API_KEY"


@dataclass(frozen=True)
class RouterConfig:
    """The router: where it listens (gRPC, and OpenAI-compatible HTTP on the same host), how it routes,
    who may call it.

    TLS (`router/tls.py` reads and checks the files when the router starts; both front ends serve with
    the same settings): `tls_cert_file` + `tls_key_file` (PEM; the chain may hold intermediates) turn
    TLS on for every listening address, gRPC and HTTP; `tls_client_ca_file` then also requires each
    client to present a certificate signed by that CA (mutual TLS). gRPC re-reads the files when they
    change, so a renewed certificate (cert-manager) is served without a restart; the HTTP front reads
    them when it starts.
    """

    host: str = "127.0.0.1"  # loopback unless deliberately exposed (the Helm chart sets 0.0.0.0)
    port: int = 50051  # 0: the OS picks a free port (tests)
    policy: str = "cache_aware"  # one of ROUTING_POLICIES
    auth_token_file: str | None = None  # a file holding the bearer token; None: no auth
    max_concurrent_requests: int = 1024  # streams beyond this are refused with RESOURCE_EXHAUSTED
    metrics_port: int | None = None  # Prometheus endpoint; None: off
    http_port: int | None = 8000  # the OpenAI-compatible HTTP API; None: off, 0: the OS picks a free port
    index_poll_interval_s: float = 0.05  # how often the in-process prefix index pulls worker KV events
    prefix_pull: str = "auto"  # one of PREFIX_PULL_MODES (needs the cache_aware policy's index)
    # A request moves to other workers at most this often when workers fail while computing it (a worker lost
    # while the request waited in its queue or during its hand-off is not counted: the request cannot have
    # caused that; its deadline still bounds it).
    migration_limit: int = 3
    worker_wait_s: float = 60.0  # a pool with no serving worker (a replacement starting) is waited for this long
    tls_cert_file: str | None = None  # PEM certificate chain the router presents; None: plaintext
    tls_key_file: str | None = None  # PEM private key of that certificate
    tls_client_ca_file: str | None = None  # PEM CA bundle client certificates must chain to (mutual TLS)
    # A plaintext port serving only the standard gRPC health service, for probes that cannot speak TLS
    # (Kubernetes' gRPC probes); None: health is served on `port` only.
    health_port: int | None = None
    # Chat tool_choice "auto": how tool calls are found in the model's text; one of TOOL_CALL_PARSERS
    # (None: "auto" is refused with a 400, "none", "required" and named choices still work).
    tool_call_parser: str | None = None
    # Chat: split the model's thinking into reasoning_content; one of REASONING_PARSERS (None: no split).
    reasoning_parser: str | None = None
    # A file holding a Jinja chat template used instead of the checkpoint's (None: the checkpoint's own).
    chat_template: str | None = None
    # Accept a chat request's own `chat_template` (Jinja the server runs, sandboxed: only for trusted clients,
    # as vLLM's --trust-request-chat-template); false: such a request is a 400.
    trust_request_chat_template: bool = False


def check_router(router: RouterConfig) -> None:
    check(isinstance(router.host, str) and bool(router.host), "router.host", "must be a non-empty string")
    check(0 <= router.port <= 65535, "router.port", "must be in [0, 65535]")
    check(router.policy in ROUTING_POLICIES, "router.policy", f"must be one of {list(ROUTING_POLICIES)}")
    check(router.max_concurrent_requests >= 1, "router.max_concurrent_requests", "must be >= 1")
    check(
        router.http_port is None or 0 <= router.http_port <= 65535,
        "router.http_port",
        "must be null (off) or in [0, 65535]",
    )
    check(
        router.metrics_port is None or 0 <= router.metrics_port <= 65535,
        "router.metrics_port",
        "must be None or in [0, 65535]",
    )
    check(router.index_poll_interval_s > 0, "router.index_poll_interval_s", "must be > 0")
    check(router.prefix_pull in PREFIX_PULL_MODES, "router.prefix_pull", f"must be one of {list(PREFIX_PULL_MODES)}")
    check(router.migration_limit >= 0, "router.migration_limit", "must be >= 0")
    check(router.worker_wait_s >= 0, "router.worker_wait_s", "must be >= 0")
    _check_tls(router)
    check(
        router.tool_call_parser is None or router.tool_call_parser in TOOL_CALL_PARSERS,
        "router.tool_call_parser",
        f"must be null or one of {list(TOOL_CALL_PARSERS)}",
    )
    check(
        router.reasoning_parser is None or router.reasoning_parser in REASONING_PARSERS,
        "router.reasoning_parser",
        f"must be null or one of {list(REASONING_PARSERS)}",
    )
    check(router.chat_template is None or bool(router.chat_template), "router.chat_template", "must be null or a path")
    check(
        router.health_port is None or 0 <= router.health_port <= 65535,
        "router.health_port",
        "must be None or in [0, 65535]",
    )
    for other in ("port", "metrics_port"):
        clash = router.health_port not in (None, 0) and router.health_port == getattr(router, other)
        check(not clash, "router.health_port", f"must differ from router.{other}")


def _check_tls(router: RouterConfig) -> None:
    for key in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        value = getattr(router, key)
        check(value is None or bool(value), f"router.{key}", "must be None or a non-empty path")
    check(
        (router.tls_cert_file is None) == (router.tls_key_file is None),
        "router.tls_key_file",
        "tls_cert_file and tls_key_file go together (a certificate and its private key)",
    )
    check(
        router.tls_client_ca_file is None or router.tls_cert_file is not None,
        "router.tls_client_ca_file",
        "mutual TLS needs the router's own certificate: set tls_cert_file and tls_key_file too",
    )
