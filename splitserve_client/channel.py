"""How a client reaches a router: the target forms every client accepts, and plaintext or TLS channels.

Targets (the SDK and every client command: generate, status, health, bench):

    HOST:PORT, [IPV6]:PORT        TCP, e.g. 127.0.0.1:50051, router.serving.svc:50051, [::1]:50051
    unix:PATH, unix:///ABS/PATH   a unix socket (`make run` serves one and prints it)
    dns:///HOST:PORT, ipv4:ADDR:PORT, ipv6:[ADDR]:PORT   gRPC's own name syntax, passed through

TLS (`ClientTls`) is on when any of its fields is given or `enabled` is set: `root_certificates`
(PEM CA bundle the router's certificate must chain to; None: the system's roots), and for mutual TLS
`certificate_chain` + `private_key` (the client's own certificate). `server_name` checks the
certificate against that name instead of the target's host (a port-forward to 127.0.0.1 of a router
whose certificate names its Service); over a unix socket the name checked is "localhost" unless
`server_name` says otherwise (gRPC would use the socket's path). Needs only grpcio: the SDK runs with
grpcio and protobuf alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

# gRPC name-resolver schemes passed through as they are.
_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")
_HOST_PORT = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
TARGET_FORMS = "HOST:PORT, [IPV6]:PORT, unix:PATH or a gRPC URI (dns:///HOST:PORT)"


def check_target(target: str) -> str:
    """Returns `target` unchanged if it has one of the accepted forms, else raises ValueError."""
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"target must be {TARGET_FORMS}, got {target!r}")
    if target.startswith(_SCHEMES):
        if not target.split(":", 1)[1].strip("/"):
            raise ValueError(f"target {target!r} names no address after its scheme")
        return target
    match = _HOST_PORT.match(target)
    if match is None or not 1 <= int(match.group(1)) <= 65535:
        raise ValueError(f"target must be {TARGET_FORMS} with a port in [1, 65535], got {target!r}")
    return target


@dataclass(frozen=True)
class ClientTls:
    """A client's TLS settings; PEM bytes, as grpc takes them."""

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None
    enabled: bool = False  # TLS with the system's roots even when no field above is given

    def __post_init__(self):
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs both certificate_chain and private_key")

    @property
    def on(self) -> bool:
        return self.enabled or any(
            v is not None for v in (self.root_certificates, self.certificate_chain, self.private_key, self.server_name)
        )

    @classmethod
    def from_files(
        cls,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        server_name: str | None = None,
        enabled: bool = False,
    ) -> ClientTls:
        """From PEM files (the CLI flags); errors name the flag and the file."""
        if (cert_file is None) != (key_file is None):
            raise ValueError("--tls-cert-file and --tls-key-file go together (a client certificate and its key)")
        return cls(
            _read_pem("--tls-ca-file", ca_file),
            _read_pem("--tls-cert-file", cert_file),
            _read_pem("--tls-key-file", key_file),
            server_name,
            enabled,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def open_channel(target: str, tls: ClientTls | None, options=(), aio: bool = False):
    """A grpc (or grpc.aio) channel to `target`, over TLS when `tls` is on."""
    check_target(target)
    grpc_mod = grpc.aio if aio else grpc
    if tls is None or not tls.on:
        return grpc_mod.insecure_channel(target, options=list(options))
    if target.startswith("unix") and tls.server_name is None:
        tls = replace(tls, server_name="localhost")
    return grpc_mod.secure_channel(target, tls.credentials(), options=[*options, *tls.channel_options()])


def connection_hint(details: str, tls: ClientTls | None) -> str:
    """What to try when a connection failed in a way gRPC words obscurely; "" when nothing fits."""
    if "Socket closed" in details or "Connection reset" in details:
        if tls is None or not tls.on:
            return (
                "the router closed the connection at once: it may be serving TLS (give the CA of its "
                "certificate: root_certificates=..., CLI --tls-ca-file FILE)"
            )
        if tls.certificate_chain is None:
            return (
                "the router closed the TLS connection at once: it may require a client certificate "
                "(mutual TLS: certificate_chain= and private_key=, CLI --tls-cert-file and --tls-key-file)"
            )
    if "WRONG_VERSION_NUMBER" in details and tls is not None and tls.on:
        return "the router does not speak TLS on this address: connect without TLS"
    return ""


def _read_pem(flag: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{flag} {path}: {err.strerror or err}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path} is not PEM (no -----BEGIN line)")
    return data
