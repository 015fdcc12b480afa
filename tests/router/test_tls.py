"""TLS on the router: the SDK, the CLI clients and `splitserve bench` over TLS against a real router,
with a CA generated in the test; mutual TLS; plaintext against TLS failing fast with a reason; the
plaintext health-only port for probes; a renewed certificate served without a restart.

One Ray cluster (1 prefill + 1 decode) for the module; each test starts the router it needs on it.
"""
from __future__ import annotations

import http.client
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Self

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import ClusterConfig, RouterConfig
from cluster.launcher import launch
from splitserve_client.client import AsyncClient, Client
from splitserve_client.sdk_types import SplitserveError, Unavailable
from tests.factories import TinySpec
from tests.router.conftest import SMALL_POOL, LoopThread
from tests.tls_certs import TestCA

REPO = Path(__file__).resolve().parents[2]
SPLITSERVE = [sys.executable, "-m", "splitserve.cli"]
PROMPT = [5, 6, 7, 8]
FAIL_FAST_S = 5.0  # a refused handshake must surface well within this, never as a hang


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca, stranger = TestCA(folder / "ca"), TestCA(folder / "stranger", "some other CA")
    return {"ca": ca, "server": ca.issue_server(), "client": ca.issue_client(),
            "stranger_client": stranger.issue_client("stranger-client"), "stranger": stranger}


@pytest.fixture(scope="module")
def cluster(ray_session, checkpoint):
    config = ClusterConfig(prefill=SMALL_POOL, decode=SMALL_POOL, ready_timeout_s=90.0)
    launched = launch(config, str(checkpoint(TinySpec())))
    loop = LoopThread()
    yield launched, loop, config
    loop.close()
    launched.shutdown()


class Router:
    """A RouterServer on the module's cluster, with the given router settings; a context manager."""

    def __init__(self, cluster, tmp_path: Path, **router):
        self.launched, self.loop, base = cluster
        self.socket = tmp_path / "router.sock"
        self.config = replace(base, router=replace(RouterConfig(), port=0, **router))
        self.server = None

    def __enter__(self) -> Self:
        from router.server import RouterServer

        self.server = self.loop.call(RouterServer.start(self.launched, self.config,
                                                        extra_addresses=[f"unix:{self.socket}"]))
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call(self.server.stop(grace_s=1.0))

    @property
    def target(self) -> str:
        return self.server.address


def _tls(issued) -> dict:
    return {"tls_cert_file": str(issued.cert_file), "tls_key_file": str(issued.key_file)}


def _cli(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*SPLITSERVE, *args], capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
                          check=False)


def test_sdk_cli_and_bench_over_tls(cluster, pki, tmp_path):
    ca = pki["ca"].ca_file
    with Router(cluster, tmp_path, **_tls(pki["server"])) as router:
        with Client(router.target, root_certificates=ca.read_bytes()) as client:
            whole = client.generate(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
            streamed = [t for c in client.generate_stream(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True) for t in c.token_ids]
            assert len(whole.token_ids) == 6 and streamed == list(whole.token_ids)
            assert len(client.status().workers) == 2
        # The certificate names router.test: checked against that name instead of the address dialled.
        with Client(router.target, root_certificates=ca.read_bytes(), tls_server_name="router.test") as client:
            assert client.model_info().vocab_size == 512

        async def via_async():
            async with AsyncClient(router.target, root_certificates=ca.read_bytes()) as client:
                return list((await client.generate(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)).token_ids)

        assert router.loop.call(via_async()) == list(whole.token_ids)
        # Every client command, over TCP and over the unix socket (TLS there too: no plaintext way round).
        for i, target in enumerate((router.target, f"unix:{router.socket}")):
            flags = ("--target", target, "--tls-ca-file", str(ca))
            generated = _cli("generate", *flags, "--max-tokens", "4", "--ignore-eos", "--usage", "hello")
            assert generated.returncode == 0 and "[4 tokens" in generated.stdout, generated.stderr
            status = _cli("status", *flags)
            assert status.returncode == 0 and "prefill" in status.stdout, status.stderr
            health = _cli("health", *flags)
            assert health.returncode == 0 and health.stdout.strip() == "SERVING", health.stderr
            bench = _cli("bench", *flags, "--num-requests", "3", "--rate", "inf", "--prompt-len", "fixed:8",
                         "--output-len", "fixed:2", "--no-progress", "--out", str(tmp_path / f"bench-{i}"))
            assert bench.returncode == 0, bench.stderr
            assert '"requests_completed": 3' in (tmp_path / f"bench-{i}" / "summary.json").read_text()


def test_plaintext_and_untrusted_clients_fail_fast_saying_why(cluster, pki, tmp_path):
    with Router(cluster, tmp_path, **_tls(pki["server"])) as router:
        started = time.monotonic()
        with Client(router.target, max_retries=0) as client, pytest.raises(Unavailable, match="--tls-ca-file"):
            client.model_info()
        stranger = pki["stranger"].ca_file.read_bytes()
        with (Client(router.target, root_certificates=stranger, max_retries=0) as client,
              pytest.raises(Unavailable, match="CERTIFICATE_VERIFY_FAILED")):
            client.model_info()
        with Client(router.target, root_certificates=pki["ca"].ca, tls_server_name="wrong.example",
                    max_retries=0) as client, pytest.raises(Unavailable, match="Hostname Verification"):
            client.model_info()
        assert time.monotonic() - started < FAIL_FAST_S
        for command in (("generate", "hi"), ("status",), ("health",)):
            started = time.monotonic()
            done = _cli(command[0], "--target", router.target, *command[1:], timeout_s=30)
            assert done.returncode != 0 and "TLS" in done.stderr, (command, done.stderr)
            assert time.monotonic() - started < 15, command  # includes starting Python
        bench = _cli("bench", "--target", router.target, "--num-requests", "1", "--no-progress")
        assert bench.returncode == 1 and "--tls-ca-file" in bench.stderr, bench.stderr


def test_the_openai_http_front_serves_https_with_the_same_keys(cluster, pki, tmp_path):
    ca = pki["ca"].ca_file
    with Router(cluster, tmp_path, **_tls(pki["server"]), http_port=0) as router:
        url = router.server.http.url
        assert url.startswith("https://127.0.0.1:")
        verified = ssl.create_default_context(cafile=str(ca))
        http_client = openai.DefaultHttpxClient(verify=verified)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60,
                           http_client=http_client) as sdk:
            done = sdk.completions.create(model=sdk.models.list().data[0].id, prompt=PROMPT, max_tokens=4,
                                          temperature=0.0, extra_body={"ignore_eos": True})
            assert done.usage.completion_tokens == 4
        with Client(router.target, root_certificates=ca.read_bytes()) as client:  # gRPC beside it, same keys
            assert len(client.generate(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True).token_ids) == 4
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # untrusted: refused
            urllib.request.urlopen(f"{url}/health", timeout=FAIL_FAST_S)
        plain = "http://" + url.removeprefix("https://")
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"{plain}/health", timeout=FAIL_FAST_S)  # plaintext against TLS: refused
        bench = _cli("bench", "--backend", "openai", "--target", url, "--tls-ca-file", str(ca), "--num-requests",
                     "2", "--rate", "inf", "--prompt-len", "fixed:8", "--output-len", "fixed:2", "--no-progress",
                     "--out", str(tmp_path / "bench"))
        assert bench.returncode == 0, bench.stderr
        assert '"requests_completed": 2' in (tmp_path / "bench" / "summary.json").read_text()


def test_mutual_tls_requires_a_client_certificate_from_the_ca(cluster, pki, tmp_path):
    ca = pki["ca"]
    with Router(cluster, tmp_path, **_tls(pki["server"]), tls_client_ca_file=str(ca.ca_file)) as router:
        with (Client(router.target, root_certificates=ca.ca, max_retries=0) as client,
              pytest.raises(Unavailable, match="client certificate")):
            client.model_info()
        stranger = pki["stranger_client"]
        with Client(router.target, root_certificates=ca.ca, certificate_chain=stranger.cert,
                    private_key=stranger.key, max_retries=0) as client, pytest.raises(Unavailable):
            client.model_info()
        mine = pki["client"]
        with Client(router.target, root_certificates=ca.ca, certificate_chain=mine.cert,
                    private_key=mine.key) as client:
            assert len(client.generate(PROMPT, max_tokens=3, ignore_eos=True).token_ids) == 3
        done = _cli("generate", "--target", router.target, "--tls-ca-file", str(ca.ca_file), "--tls-cert-file",
                    str(mine.cert_file), "--tls-key-file", str(mine.key_file), "--max-tokens", "3", "hi")
        assert done.returncode == 0, done.stderr
        refused = _cli("health", "--target", router.target, "--tls-ca-file", str(ca.ca_file))
        assert refused.returncode != 0 and "--tls-cert-file" in refused.stderr, refused.stderr


def test_health_port_answers_probes_in_plaintext_and_nothing_else(cluster, pki, tmp_path):
    with Router(cluster, tmp_path, **_tls(pki["server"]), health_port=0) as router:
        probe_target = f"127.0.0.1:{router.server.health_port}"
        with grpc.insecure_channel(probe_target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with Client(probe_target, max_retries=0) as client, pytest.raises(SplitserveError) as caught:
            client.model_info()
        assert caught.value.code == grpc.StatusCode.UNIMPLEMENTED
        assert _cli("health", "--target", probe_target).stdout.strip() == "SERVING"


def test_a_renewed_certificate_is_served_without_a_restart(cluster, pki, tmp_path):
    first = TestCA(tmp_path / "first", "first CA").issue_server()
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(first.cert)
    key.write_bytes(first.key)
    with Router(cluster, tmp_path, tls_cert_file=str(cert), tls_key_file=str(key)) as router:
        with Client(router.target, root_certificates=first.ca) as client:
            assert client.model_info().vocab_size == 512
        renewed = TestCA(tmp_path / "renewed", "renewed CA").issue_server()
        # As the kubelet updates a Secret volume: new files renamed into place, here the key first. While
        # the pair does not match, the previous one is still served.
        _replace(key, renewed.key)
        with Client(router.target, root_certificates=first.ca) as client:
            assert client.model_info().vocab_size == 512
        _replace(cert, renewed.cert)
        with Client(router.target, root_certificates=renewed.ca) as client:
            assert client.model_info().vocab_size == 512
        with (Client(router.target, root_certificates=first.ca, max_retries=0) as client,
              pytest.raises(Unavailable, match="CERTIFICATE_VERIFY_FAILED")):
            client.model_info()


def _replace(path: Path, data: bytes) -> None:
    staged = path.with_suffix(".new")
    staged.write_bytes(data)
    os.replace(staged, path)
