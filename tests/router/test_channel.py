"""The target forms every client accepts, the client TLS settings, and what a client is told when a
connection fails in a way gRPC words obscurely. No router needed."""
from __future__ import annotations

import argparse
import warnings

import pytest

from splitserve_client.channel import ClientTls, check_target, connection_hint
from splitserve_client.cli_args import add_connection_flags, connection_from_args
from splitserve_client.client import Client
from tests.tls_certs import TestCA

GOOD = ["127.0.0.1:50051", "localhost:1", "router.serving.svc:443", "[::1]:50051", "my_host-2:65535",
        "unix:/tmp/router.sock", "unix:relative.sock", "unix:///abs/router.sock", "dns:///router:50051",
        "ipv4:10.0.0.1:50051", "ipv6:[::1]:50051"]
BAD = ["", " ", "localhost", "127.0.0.1", "h:0", "h:70000", "h:port", ":50051", "unix:", "dns:///",
       "http://router:50051", "a b:1"]


@pytest.mark.parametrize("target", GOOD)
def test_accepted_target_forms(target):
    assert check_target(target) == target
    Client(target).close()  # the SDK takes every form the CLI does


@pytest.mark.parametrize("target", BAD)
def test_rejected_target_forms_say_what_is_accepted(target):
    with pytest.raises(ValueError, match="target"):
        check_target(target)
    with pytest.raises(ValueError):
        Client(target)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_connection_flags(parser)
    return parser.parse_args(list(argv))


def test_connection_flags_read_and_check_their_files(tmp_path):
    ca = TestCA(tmp_path)
    client = ca.issue_client()
    token = tmp_path / "token"
    token.write_text(" s3cret \n")
    connection = connection_from_args(_args("--target", "unix:/run/r.sock", "--tls-ca-file", str(ca.ca_file),
                                            "--tls-cert-file", str(client.cert_file), "--tls-key-file",
                                            str(client.key_file), "--auth-token-file", str(token)))
    assert connection.target == "unix:/run/r.sock" and connection.token == "s3cret"
    assert connection.tls.root_certificates == ca.ca and connection.tls.private_key == client.key
    assert connection.tls.on and not connection_from_args(_args()).tls.on
    assert connection_from_args(_args("--tls")).tls.on
    for argv, message in ((("--target", "nowhere"), "--target: target must be"),
                          (("--tls-ca-file", str(tmp_path / "none.pem")), "--tls-ca-file"),
                          (("--tls-ca-file", str(token)), "is not PEM"),
                          (("--tls-key-file", str(client.key_file)), "go together"),
                          (("--auth-token-file", str(tmp_path / "none")), "--auth-token-file")):
        with pytest.raises(ValueError, match=message):
            connection_from_args(_args(*argv))


def test_client_tls_settings():
    assert not ClientTls().on and ClientTls(enabled=True).on and ClientTls(server_name="x").on
    with pytest.raises(ValueError, match="both"):
        ClientTls(private_key=b"k")
    with pytest.raises(TypeError, match="not both"):
        Client("127.0.0.1:1", tls=ClientTls(), root_certificates=b"x")


def test_hints_for_tls_mismatches():
    closed = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed"
    assert "--tls-ca-file" in connection_hint(closed, None)
    assert "client certificate" in connection_hint(closed, ClientTls(root_certificates=b"ca"))
    assert connection_hint(closed, ClientTls(b"ca", b"cert", b"key")) == ""
    assert "without TLS" in connection_hint("Tls handshake failed: WRONG_VERSION_NUMBER", ClientTls(enabled=True))
    assert connection_hint("Connection refused", None) == ""


def test_a_token_sent_in_clear_over_a_network_warns():
    with pytest.warns(UserWarning, match="without TLS"):
        Client("router.example.com:50051", token="t").close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for target in ("127.0.0.1:50051", "localhost:50051", "[::1]:50051", "unix:/run/r.sock"):
            Client(target, token="t").close()
        Client("router.example.com:50051", token="t", tls=True).close()
