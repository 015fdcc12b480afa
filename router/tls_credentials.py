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
from common.ports import cannot_listen, unix_socket_error
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
    Returns the TCP port bound; raises common.ports.PortInUse (CannotListen for other reasons) naming
    router.port when it cannot listen there, CannotListenOnSocket naming --uds for a unix socket, OSError
    when another extra address cannot be bound."""
    tls = server_credentials(router) is not None

    def add(address: str) -> int:
        try:
            if tls:
                return server.add_secure_port(address, server_credentials(router))
            return server.add_insecure_port(address)
        except RuntimeError:  # newer grpcio raises where older ones return 0
            return 0

    port = add(f"{router.host}:{router.port}")
    if port == 0:
        raise cannot_listen("router.port", router.host, router.port)
    for address in extra_addresses:
        if add(address) == 0:
            if address.startswith("unix:"):
                raise unix_socket_error("--uds", address.removeprefix("unix:"))
            raise OSError(f"cannot listen on {address}")
    return port
