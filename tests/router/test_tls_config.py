"""The router's TLS settings: validated in the one config, files checked naming the key and the path,
and the `ssl.SSLContext` an HTTP front would serve with doing real handshakes."""
from __future__ import annotations

import asyncio
import ssl

import pytest

from common.config import ClusterConfig, ConfigError
from router.tls import TlsFiles, load_server_tls, server_ssl_context
from splitserve.serve import build_config, parser
from tests.tls_certs import TestCA


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca = TestCA(folder / "ca")
    return ca, ca.issue_server(), ca.issue_client(), TestCA(folder / "other", "other CA").issue_server("other")


def _router(**keys) -> ClusterConfig:
    return ClusterConfig.from_dict({"router": keys})


@pytest.mark.parametrize("keys, named", [
    ({"tls_cert_file": "c.pem"}, "router.tls_key_file"),
    ({"tls_key_file": "k.pem"}, "router.tls_key_file"),
    ({"tls_client_ca_file": "ca.pem"}, "router.tls_client_ca_file"),
    ({"tls_cert_file": "", "tls_key_file": "k.pem"}, "router.tls_cert_file"),
    ({"tls_cert_file": 3, "tls_key_file": "k.pem"}, "router.tls_cert_file"),
    ({"health_port": 70000}, "router.health_port"),
    ({"health_port": 50051}, "router.health_port: must differ from router.port"),
    ({"health_port": 9000, "metrics_port": 9000}, "router.health_port: must differ from router.metrics_port"),
])
def test_config_rules_name_the_key(keys, named):
    with pytest.raises(ConfigError, match=named):
        _router(**keys)


def test_serve_flags_reach_the_config_and_are_validated_there(pki):
    _, server, _, _ = pki
    config, _ = build_config(parser("splitserve serve").parse_args([
        "--tls-cert-file", str(server.cert_file), "--tls-key-file", str(server.key_file), "--health-port", "8081"]))
    assert (config.router.tls_cert_file, config.router.health_port) == (str(server.cert_file), 8081)
    with pytest.raises(ConfigError, match="router.tls_key_file"):
        build_config(parser("splitserve serve").parse_args(["--tls-cert-file", str(server.cert_file)]))


def test_unusable_files_are_named(pki, tmp_path):
    ca, server, _, other = pki
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    cases = [
        ({"tls_cert_file": str(tmp_path / "missing.pem"), "tls_key_file": str(server.key_file)},
         f"router.tls_cert_file: cannot read {tmp_path / 'missing.pem'}"),
        ({"tls_cert_file": str(server.cert_file), "tls_key_file": str(not_pem)},
         f"router.tls_key_file: {not_pem} is not PEM"),
        ({"tls_cert_file": str(server.cert_file), "tls_key_file": str(other.key_file)},
         "router.tls_cert_file / router.tls_key_file"),  # a key that is not the certificate's
        ({"tls_cert_file": str(server.cert_file), "tls_key_file": str(server.key_file),
          "tls_client_ca_file": str(server.key_file)}, "router.tls_client_ca_file"),
    ]
    for keys, message in cases:
        with pytest.raises(ConfigError, match=message.replace("/", ".")):
            load_server_tls(_router(**keys).router)
    assert load_server_tls(ClusterConfig().router) is None and server_ssl_context(ClusterConfig().router) is None
    material = load_server_tls(_router(tls_cert_file=str(server.cert_file), tls_key_file=str(server.key_file),
                                       tls_client_ca_file=str(ca.ca_file)).router)
    assert material.certificate_chain == server.cert and material.client_ca == ca.ca


def test_files_are_reloaded_only_when_changed_and_valid(pki, tmp_path):
    _, server, _, other = pki
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(server.cert)
    key.write_bytes(server.key)
    files = TlsFiles(_router(tls_cert_file=str(cert), tls_key_file=str(key)).router)
    assert files.reload_if_changed() is None
    cert.write_bytes(other.cert)  # the key still belongs to the old certificate: not usable yet
    assert files.reload_if_changed() is None and files.current.certificate_chain == server.cert
    key.write_bytes(other.key)
    assert files.reload_if_changed().certificate_chain == other.cert == files.current.certificate_chain
    assert files.reload_if_changed() is None


async def _handshake(server_context: ssl.SSLContext, client_context: ssl.SSLContext) -> bytes:
    async def echo(reader, writer):
        writer.write(await reader.readexactly(4))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=server_context)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, ssl=client_context, server_hostname="localhost"), 5)
        writer.write(b"ping")
        reply = await asyncio.wait_for(reader.readexactly(4), 5)
        writer.close()
        return reply
    finally:
        server.close()
        await server.wait_closed()


def test_ssl_context_for_an_http_front_serves_tls_and_mutual_tls(pki):
    ca, server, client, _ = pki
    router = _router(tls_cert_file=str(server.cert_file), tls_key_file=str(server.key_file)).router
    trusting = ssl.create_default_context(cafile=str(ca.ca_file))
    assert asyncio.run(_handshake(server_ssl_context(router), trusting)) == b"ping"
    mutual = _router(tls_cert_file=str(server.cert_file), tls_key_file=str(server.key_file),
                     tls_client_ca_file=str(ca.ca_file)).router
    with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
        asyncio.run(_handshake(server_ssl_context(mutual), trusting))
    with_cert = ssl.create_default_context(cafile=str(ca.ca_file))
    with_cert.load_cert_chain(str(client.cert_file), str(client.key_file))
    assert asyncio.run(_handshake(server_ssl_context(mutual), with_cert)) == b"ping"
