"""The client SDK, installed on its own from sdk/ (`pip install ./sdk`, which `make test` does into
`.venv-sdk`), works in an environment that has only grpcio and protobuf: no torch, no ray, no transformers,
and no checkout of the repository on its path."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SDK_PYTHON = Path(os.environ.get("SPLITSERVE_SDK_PYTHON", REPO / ".venv-sdk" / "bin" / "python"))

SCRIPT = r"""
import asyncio, importlib.util, json, sys
import splitserve_client
from splitserve_client import AsyncClient, Client, InvalidArgument

absent = [m for m in ("torch", "ray", "transformers", "numpy") if importlib.util.find_spec(m) is not None]
target = sys.argv[1]
with Client(target) as client:
    info = client.model_info()
    streamed = [c.token_ids for c in client.generate_stream([5, 6, 7], max_tokens=6, temperature=0.0, ignore_eos=True)]
    whole = client.generate([5, 6, 7], max_tokens=6, temperature=0.0, ignore_eos=True)
    status = client.status()
    try:
        client.generate([5, 6, 7], top_p=2.0)
        error = None
    except InvalidArgument as err:
        error = [err.code.name, err.field]

async def run_async():
    async with AsyncClient(target) as client:
        done = await client.generate([5, 6, 7], max_tokens=6, temperature=0.0, ignore_eos=True)
        return list(done.token_ids)

print(json.dumps({"installed_at": splitserve_client.__file__, "importable": absent, "vocab": info.vocab_size, "streamed": [t for c in streamed for t in c],
                  "whole": list(whole.token_ids), "async": asyncio.run(run_async()), "error": error,
                  "workers": len(status.workers), "modules": sorted(m for m in sys.modules if m.split(".")[0] in
                                                                   ("torch", "ray", "engine", "cluster"))}))
"""


def test_sdk_runs_with_only_grpcio_and_protobuf(router_stack):
    assert SDK_PYTHON.exists(), f"{SDK_PYTHON} is missing: `make sdk-venv` (part of `make test`) creates it"
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp")}  # no repository on the path
    done = subprocess.run([str(SDK_PYTHON), "-c", SCRIPT, router_stack.target], capture_output=True, text=True,
                          env=env, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert "site-packages" in result["installed_at"]  # the installed copy, not the checkout's splitserve_client/
    assert result["importable"] == [] and result["modules"] == []
    assert result["vocab"] == 512 and result["workers"] == 2
    assert result["streamed"] == result["whole"] == result["async"] and len(result["whole"]) == 6
    assert result["error"] == ["INVALID_ARGUMENT", "sampling.top_p"]
