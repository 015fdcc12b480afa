"""The flags every client command shares (`generate`, `status`, `health`, `bench`): where the router
is, how to trust it (TLS) and the bearer token. One definition, so the commands accept the same forms.

    --target HOST:PORT | [IPV6]:PORT | unix:PATH | dns:///HOST:PORT
    --tls-ca-file F [--tls-cert-file F --tls-key-file F] [--tls-server-name NAME] | --tls
    --auth-token-file F
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from splitserve_client.channel import TARGET_FORMS, ClientTls, check_target

DEFAULT_TARGET = "127.0.0.1:50051"


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=DEFAULT_TARGET, help=f"router address: {TARGET_FORMS} (default %(default)s)"
    )
    parser.add_argument("--auth-token-file", help="file holding the router's bearer token")
    tls = parser.add_argument_group("TLS (any of these turns it on)")
    tls.add_argument("--tls-ca-file", help="PEM CA bundle the router's certificate must chain to")
    tls.add_argument("--tls-cert-file", help="PEM client certificate, for a router requiring mutual TLS")
    tls.add_argument("--tls-key-file", help="PEM private key of --tls-cert-file")
    tls.add_argument(
        "--tls-server-name",
        help="check the router's certificate against this name instead of "
        "the target's host (e.g. through a port-forward)",
    )
    tls.add_argument("--tls", action="store_true", help="use TLS trusting the system's CA roots")


@dataclass(frozen=True)
class Connection:
    target: str
    tls: ClientTls
    token: str | None

    def client_kwargs(self) -> dict:
        """Keyword arguments for the SDK's Client / AsyncClient."""
        return {"token": self.token, "tls": self.tls}


def connection_from_args(args: argparse.Namespace) -> Connection:
    """Validated connection settings; ValueError naming the flag on a bad one."""
    try:
        target = check_target(args.target)
    except ValueError as err:
        raise ValueError(f"--target: {err}") from None
    tls = ClientTls.from_files(
        args.tls_ca_file, args.tls_cert_file, args.tls_key_file, args.tls_server_name, enabled=args.tls
    )
    return Connection(target, tls, read_token(args.auth_token_file))


def read_token(path: str | None) -> str | None:
    """The bearer token in `path` (surrounding whitespace stripped); None without a file."""
    if path is None:
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as err:
        raise ValueError(f"--auth-token-file {path}: {err.strerror or err}") from None
    if not token:
        raise ValueError(f"--auth-token-file {path} is empty")
    return token
