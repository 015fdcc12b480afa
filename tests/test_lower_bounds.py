"""pyproject.toml's lower bounds are true: a venv holding exactly them (`.venv-lower`, made by
`make test` from `scripts/lower_bounds.py`) imports every product module and serves a request end to
end — Ray workers, the gRPC router with a Redis prefix index and a metrics endpoint, the SDK — and
`splitserve bench --plot` there says it needs the plot extra instead of failing mid-run."""
from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path

from tests.factories import TinySpec
from tests.redis_server import RedisServer
from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[1]
LOWER_PYTHON = Path(os.environ.get("SPLITSERVE_LOWER_PYTHON", REPO / ".venv-lower" / "bin" / "python"))
# Every top-level package of the distribution (the layering contract in pyproject.toml lists them all).
PACKAGES = tuple(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"])
lower_bound_pin = load_script("lower_bounds").lower_bound_pin

SCRIPT = r"""
import asyncio, importlib, importlib.util, json, pkgutil, sys, tempfile
from importlib import metadata

model_dir, redis_url, packages = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
modules = 0
for package in packages:
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        # The Triton kernels (and the GPU benchmarks and tuners built on them) need triton, which comes
        # with torch's CUDA build (a CPU runtime never imports them: attention and the int8 matmul load
        # them on first CUDA use); every other module must import.
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as error:
            if error.name != "triton" and not (error.name or "").startswith("triton."):
                raise
            assert importlib.util.find_spec("triton") is None, error
            continue
        modules += 1

import ray
from common.config import ClusterConfig, PoolConfig, RouterConfig
from cluster.launcher import launch
from splitserve_client.client import AsyncClient
from router.server import RouterServer

ray.init(num_cpus=4, include_dashboard=False, namespace="lower", configure_logging=False,
         _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"))
pool = PoolConfig(num_cpus=0.5, num_kv_blocks=128, threads=1)
config = ClusterConfig(prefill=pool, decode=pool, ready_timeout_s=90.0, redis_url=redis_url,
                       router=RouterConfig(port=0, metrics_port=0))
cluster = launch(config, model_dir)

async def serve_one():
    server = await RouterServer.start(cluster, config)
    try:
        async with AsyncClient(server.address) as client:
            done = await client.generate([5, 6, 7, 8], max_tokens=4, temperature=0.0, ignore_eos=True)
        return list(done.token_ids), server.exporter.port > 0
    finally:
        await server.stop(grace_s=1.0)

try:
    tokens, metrics_up = asyncio.run(serve_one())
finally:
    cluster.shutdown()
installed = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in metadata.distributions()}
print(json.dumps({"modules": modules, "tokens": tokens, "metrics": metrics_up, "installed": installed}))
"""


def _runtime_lower_bounds() -> dict[str, str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pins = [lower_bound_pin(r) for r in pyproject["project"]["dependencies"]]
    return {pin.split("[")[0].split("==")[0].lower().replace("_", "-"): pin.split("==")[1] for pin in pins}


def test_the_lower_bounds_serve_a_request(checkpoint, tmp_path):
    assert LOWER_PYTHON.exists(), f"{LOWER_PYTHON} is missing: `make lower-venv` (part of `make test`) makes it"
    redis = RedisServer(workdir=str(tmp_path / "redis")).start()
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO), "HOME": os.environ.get("HOME", "/tmp"),
           **{k: v for k, v in os.environ.items() if k.startswith(("RAY_", "GLOO_", "HF_", "TRANSFORMERS_"))}}
    try:
        done = subprocess.run([str(LOWER_PYTHON), "-c", SCRIPT, str(checkpoint(TinySpec())), redis.url,
                               ",".join(PACKAGES)], capture_output=True, text=True, env=env, timeout=240,
                              cwd="/", check=False)
    finally:
        redis.kill()
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["modules"] > 100 and len(result["tokens"]) == 4 and result["metrics"]
    wanted = _runtime_lower_bounds()
    installed = {name: result["installed"].get(name) for name in wanted}
    assert installed.pop("torch").split("+")[0] == wanted.pop("torch")
    assert installed == wanted, "the venv does not hold exactly the lower bounds: `make lower-venv` again"


def test_bench_plots_need_the_plot_extra(tmp_path):
    """The runtime set has no matplotlib: `--plot` fails before any request, naming the extra."""
    done = subprocess.run([str(LOWER_PYTHON), "-m", "splitserve.cli", "bench", "--plot", str(tmp_path)],
                          capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"]},
                          timeout=60, cwd="/", check=False)
    assert done.returncode == 2 and "splitserve[plot]" in done.stderr, done.stderr
