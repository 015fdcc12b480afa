"""Shared fixtures: tiny checkpoints built once per session, and engines whose block pools are checked
for integrity (and for leaked blocks) after every test that made one."""
from __future__ import annotations

import os
import tempfile

import pytest

from tests.factories import TinySpec, make_tiny_checkpoint
from tests.sandbox_guard import require_sandbox

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(spec) → directory of a tiny random HF checkpoint, built once per distinct spec."""
    built: dict[str, object] = {}

    def get(spec: TinySpec = TinySpec()):
        key = repr(spec)
        if key not in built:
            built[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(spec.arch), spec)
        return built[key]

    return get


@pytest.fixture
def make_llm():
    """make_llm(model_dir, **engine_args) → LLM; at teardown every engine made must have no request
    left, every block back in the free queue, and a pool that passes its integrity check."""
    from engine import LLM

    made = []

    def make(model_dir, **engine_args):
        llm = LLM(model_dir, progress=False, **engine_args)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_engine_clean(llm.engine)


def assert_engine_clean(engine) -> None:
    engine.kv.check_integrity()
    assert not engine.has_unfinished(), "requests left in the scheduler"
    assert engine.kv.num_free_blocks == engine.num_blocks, (
        f"leaked KV blocks: {engine.num_blocks - engine.kv.num_free_blocks} still held")
    assert not engine.structured.matchers, f"leaked grammar matchers: {sorted(engine.structured.matchers)}"


# One Ray session per test run (init ~2.5 s, shutdown ~1.3 s), started inside the sandbox the
# test runner provides, with Ray's files under a short temporary directory.
@pytest.fixture(scope="session")
def ray_session():
    import ray

    require_sandbox()

    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    ray.init(num_cpus=8, include_dashboard=False, namespace="splitserve", _temp_dir=temp_dir,
             configure_logging=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1",
                                                                "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def metrics_exporter():
    """(mount registry, MetricsServer): one Prometheus exporter on 127.0.0.1 per test module; tests
    register their metrics' registries on the mount (stopping an exporter takes up to 0.5 s)."""
    from prometheus_client import CollectorRegistry

    from common.metrics_http import start_metrics_server

    mount = CollectorRegistry()
    server = start_metrics_server(mount)
    yield mount, server
    server.stop()


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip, saying why, where torch sees no CUDA device (CI); on a GPU they run."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none (run on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
