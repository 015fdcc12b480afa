"""The router's TLS files (`RouterConfig.tls_*`): read and checked at start, re-read when they change.

Every front end of the router serves with these same settings: the gRPC server turns them into
grpc credentials (`router/tls_credentials.py`); an HTTP front takes `server_ssl_context`. Errors are
`ConfigError`s naming the config key and the file.

Certificates are renewed in place (cert-manager rewrites the Secret; the kubelet swaps the mounted
files through a symlink), so `TlsFiles.reload_if_changed` re-reads them when any file's identity
(inode, size, modification time) moved, and keeps serving the previous set while the new one is
incomplete (a certificate already swapped, its key not yet) or invalid.

Standard library only: no grpc here (cluster types must not need the router's dependencies).
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

from common.config import ConfigError, RouterConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerTls:
    """One consistent set of the router's TLS material, PEM bytes."""

    certificate_chain: bytes
    private_key: bytes
    client_ca: bytes | None  # set: clients must present a certificate chaining to it (mutual TLS)


def tls_enabled(router: RouterConfig) -> bool:
    return router.tls_cert_file is not None


def load_server_tls(router: RouterConfig) -> ServerTls | None:
    """The material the config names, checked to be a usable certificate + key (+ CA); None when TLS
    is off. Raises ConfigError naming the key and the file."""
    if not tls_enabled(router):
        return None
    server_ssl_context(router)  # parses and pairs them: a wrong file fails here, naming it
    return ServerTls(
        _read(router, "tls_cert_file"),
        _read(router, "tls_key_file"),
        _read(router, "tls_client_ca_file") if router.tls_client_ca_file else None,
    )


def server_ssl_context(router: RouterConfig) -> ssl.SSLContext | None:
    """An `ssl.SSLContext` serving the router's certificate (and requiring client certificates under
    mutual TLS), for front ends built on the standard library's ssl; None when TLS is off."""
    if not tls_enabled(router):
        return None
    for key in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        if getattr(router, key) is not None:
            _read(router, key)  # unreadable files are named before ssl's less specific errors
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    assert router.tls_cert_file is not None, "tls_enabled"
    try:
        context.load_cert_chain(router.tls_cert_file, router.tls_key_file)
    except (ssl.SSLError, ValueError) as err:
        raise ConfigError(
            f"router.tls_cert_file / router.tls_key_file: {router.tls_cert_file} and "
            f"{router.tls_key_file} are not a PEM certificate chain and its private key "
            f"({_reason(err)})"
        ) from None
    if router.tls_client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=router.tls_client_ca_file)
        except (ssl.SSLError, ValueError) as err:
            raise ConfigError(
                f"router.tls_client_ca_file: {router.tls_client_ca_file} holds no PEM CA certificate ({_reason(err)})"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class TlsFiles:
    """The current material and the files' identities; thread-safe (gRPC asks from its own threads)."""

    def __init__(self, router: RouterConfig):
        self.router = router
        self._lock = threading.Lock()
        self._stamp = self._identity()
        material = load_server_tls(router)
        if material is None:
            raise ConfigError("router.tls_cert_file: TLS is off, there are no files to watch")
        self.current: ServerTls = material

    def reload_if_changed(self) -> ServerTls | None:
        """The new material when a file changed and the new set is valid, else None (keep serving
        the current one)."""
        with self._lock:
            stamp = self._identity()
            if stamp == self._stamp:
                return None
            try:
                material = load_server_tls(self.router)
            except ConfigError as err:
                log.warning("TLS files changed but are not usable yet; serving the previous ones: %s", err)
                return None
            assert material is not None, "a reloader exists only while TLS is on"
            self._stamp, self.current = stamp, material
            log.info("TLS certificate reloaded from %s", self.router.tls_cert_file)
            return material

    def _identity(self) -> tuple:
        paths = (self.router.tls_cert_file, self.router.tls_key_file, self.router.tls_client_ca_file)
        return tuple(_file_identity(path) for path in paths if path is not None)


def _file_identity(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)  # follows the symlinks a Kubernetes Secret volume swaps on update
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _read(router: RouterConfig, key: str) -> bytes:
    path = getattr(router, key)
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"router.{key}: cannot read {path}: {err.strerror or err}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"router.{key}: {path} is not PEM (no -----BEGIN line)")
    return data


def _reason(err: Exception) -> str:
    return getattr(err, "reason", None) or str(err) or type(err).__name__
