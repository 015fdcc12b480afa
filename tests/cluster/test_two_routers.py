"""Routers are stateless peers of one cluster (Ray started with `ray start --head`, every process a real
one): both serve exact output; SIGKILL one router mid-stream and the workers and the other router go on,
while the killed router's requests leave no block behind on any worker; a router with no controller to
join fails within seconds."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import yaml

from splitserve_client.client import Client
from tests.cluster.processes import ServingProcess
from tests.cluster.ray_head import RayHead
from tests.factories import TinySpec, hf_greedy_generate, random_prompts

GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
POOLS = {"num_cpus": 0.5, "num_kv_blocks": 256, "threads": 1}
# Each router's own settings; the pools come from the controller (the second router is given none).
CONFIG = {"prefill": POOLS, "decode": POOLS, "handoff_lease_s": 8.0, "ready_timeout_s": 120.0}


@pytest.fixture
def head():
    ray_head = RayHead(num_cpus=4)
    yield ray_head
    ray_head.stop()


def _exact(target: str, model_dir, prompts) -> None:
    with Client(target) as client:
        got = [list(client.generate(p, **GREEDY).token_ids) for p in prompts]
    assert got == hf_greedy_generate(model_dir, prompts, GREEDY["max_tokens"])


def _probe_clean(head: RayHead, name: str, wait_s: float) -> str:
    result = subprocess.run([sys.executable, "-m", "tests.cluster.cluster_probe", "--ray-address", head.address,
                             "--cluster-name", name, "--wait-clean", str(wait_s)],
                            capture_output=True, text=True, timeout=wait_s + 90)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    return result.stdout


def test_two_routers_serve_one_cluster_and_outlive_each_other(head, checkpoint, tmp_path):
    model_dir = checkpoint(TinySpec())
    config_file = tmp_path / "cluster.yaml"
    config_file.write_text(yaml.safe_dump(CONFIG))
    common = ["--ray-address", head.address, "--cluster-name", "peers", "--port", "0", "--http-port", "0"]
    first = ServingProcess(["serve", "--config", str(config_file), "--model", str(model_dir), *common])
    second = ServingProcess(["router", *common])
    try:
        prompts = random_prompts(3, 10, 60, 512, seed=21)
        _exact(first.target, model_dir, prompts)
        _exact(second.target, model_dir, prompts)
        streams = _start_long_streams(first.target, 3)
        _wait_decoding(second.target, at_least=3)  # the first router's streams run on the shared workers
        first.kill()  # SIGKILL: no cleanup of its own
        _exact(second.target, model_dir, random_prompts(3, 10, 60, 512, seed=22))
        for thread in streams:
            thread.join(timeout=30)
        # Its requests are dropped once the workers notice it stopped polling (within the lease).
        _probe_clean(head, "peers", wait_s=CONFIG["handoff_lease_s"] + 15)
        _exact(second.target, model_dir, prompts[:1])  # the cluster still serves
    finally:
        first.kill()
        second.kill()


def _wait_decoding(target: str, at_least: int, timeout_s: float = 20.0) -> None:
    """Until the decode pool runs `at_least` sequences (as any router's status shows it)."""
    deadline_s = time.monotonic() + timeout_s
    with Client(target) as client:
        while sum(w["running"] for w in client.status().workers if w["role"] == "decode") < at_least:
            assert time.monotonic() < deadline_s, client.status().workers
            time.sleep(0.1)


def _start_long_streams(target: str, count: int) -> list[threading.Thread]:
    def stream(i: int) -> None:
        try:
            with Client(target) as client:
                for _ in client.generate_stream([5 + i] * 30, temperature=0.0, max_tokens=450, ignore_eos=True):
                    pass
        except Exception:  # its router dies under it: expected
            pass

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_a_router_with_no_controller_to_join_fails_within_seconds(head):
    started_s = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "splitserve.cli", "router", "--ray-address", head.address,
                             "--cluster-name", "nobody", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "no controller runs for cluster 'nobody'" in result.stderr
    assert time.monotonic() - started_s < 30
