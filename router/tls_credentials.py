"""gRPC server credentials from the router's TLS settings, and the addresses the router listens on.

`server_credentials` serves the certificate in `router.tls_cert_file` and, under mutual TLS, requires
a client certificate chaining to `router.tls_client_ca_file`. gRPC asks for the certificate before
every new connection's handshake; the answer is the current one, re-read from disk when the files
changed (`router.tls.TlsFiles`), so a renewed certificate is served without a restart while
connections already open keep theirs.
"""

from __future__ import annotations

import grpc

from common.config import RouterConfig
from router.tls import ServerTls, TlsFiles, tls_enabled


def server_credentials(router: RouterConfig) -> grpc.ServerCredentials | None:
    """None when TLS is off. Raises ConfigError naming the key when a file is missing or unusable.
    One per listening address: gRPC takes a dynamic credentials object's first certificate for one
    port only, and each port then keeps its own view of which files it has loaded."""
    if not tls_enabled(router):
        return None
    files = TlsFiles(router)

    def fetch() -> grpc.ServerCertificateConfiguration | None:  # gRPC: None keeps the current one
        fresh = files.reload_if_changed()
        return None if fresh is None else _configuration(fresh)

    # type: ignore: gRPC documents a fetch returning None as "keep the current one"; the stub omits it.
    return grpc.dynamic_ssl_server_credentials(
        _configuration(files.current),
        fetch,  # type: ignore[arg-type]
        require_client_authentication=router.tls_client_ca_file is not None,
    )


def _configuration(material: ServerTls) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(material.private_key, material.certificate_chain)], root_certificates=material.client_ca
    )


def bind(server, router: RouterConfig, extra_addresses=()) -> int:
    """Binds router.host:router.port and every extra address (e.g. "unix:/path/router.sock") with the
    same security: TLS everywhere when configured, so no address is a plaintext way around it.
    Returns the TCP port bound; raises OSError when it cannot listen."""
    addresses = [f"{router.host}:{router.port}", *extra_addresses]
    if server_credentials(router) is None:
        ports = [server.add_insecure_port(a) for a in addresses]
    else:
        ports = [server.add_secure_port(a, server_credentials(router)) for a in addresses]
    if ports[0] == 0:
        raise OSError(f"cannot listen on {router.host}:{router.port}")
    return ports[0]
