"""Real worker processes for the transport contract tests: no mocks, real process groups.

Each ``Agent`` is a spawned process hosting one ``TorchDistTransport``, driven over a pipe: the test
hands it a list of ops (send / recv / close_peer / sleep / parallel) and collects one result per op.
Agents live for the whole module (starting a process that imports torch costs seconds on 2 cores);
every test gives them fresh transport ids, so no channel state leaks from one test into the next.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import traceback
from typing import Any

import pytest
import torch

# Gloo binds the interface this names; the sandbox only has loopback, outside it this keeps us there.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

REPLY_TIMEOUT_S = 30.0  # how long a test waits for an agent's answer before declaring it hung
_SPAWN = multiprocessing.get_context("spawn")


def make_out(spec: tuple, device: str) -> torch.Tensor:
    """A receive buffer filled with garbage; spec = (shape, dtype, contiguous)."""
    shape, dtype, contiguous = spec
    if contiguous:
        return torch.full(shape, 7, dtype=dtype, device=device)
    # Every other element of a twice-as-large buffer: a strided, non-contiguous view.
    return torch.full((*shape, 2), 7, dtype=dtype, device=device)[..., 0]


def _run_op(transport: Any, op: dict, device: str) -> dict:
    kind = op["op"]
    start_s = time.monotonic()
    try:
        if kind == "send":
            stats = transport.send(op["peer"], [t.to(device) for t in op["tensors"]], op["timeout_s"])
            return {"ok": True, "num_bytes": stats.num_bytes, "elapsed_s": time.monotonic() - start_s}
        if kind == "recv":
            out = [make_out(spec, device) for spec in op["specs"]]
            stats = transport.recv(op["peer"], out, op["timeout_s"])
            return {"ok": True, "tensors": [t.cpu() for t in out], "num_bytes": stats.num_bytes,
                    "elapsed_s": time.monotonic() - start_s}
        if kind == "stream":
            return _run_stream(transport, op, device)
        if kind == "forget_peer":
            time.sleep(op.get("after_s", 0.0))
            return {"ok": True, "closed": transport.forget_peer(op["peer"]), "elapsed_s": time.monotonic() - start_s}
        if kind == "close_peer":
            transport.close_peer(op["peer"])
        elif kind == "sleep":
            time.sleep(op["s"])
        elif kind == "parallel":
            return {"ok": True, "results": _run_parallel(transport, op["ops"], device)}
        return {"ok": True, "elapsed_s": time.monotonic() - start_s}
    except Exception as exc:  # reported to the test, which asserts on type and text
        return {"ok": False, "type": type(exc).__name__, "error": str(exc), "elapsed_s": time.monotonic() - start_s}


def _run_stream(transport: Any, op: dict, device: str) -> dict:
    """Send or receive ``count`` messages of one ``numel``-float tensor, built here (not pickled)."""
    buffer = torch.ones(op["numel"], device=device)
    move = transport.send if op["direction"] == "send" else transport.recv
    done = 0
    while True:  # elapsed_s: of the last call, the one that failed if any
        start_s = time.monotonic()
        try:
            if done == op["count"]:
                return {"ok": True, "done": done, "elapsed_s": 0.0}
            move(op["peer"], [buffer], op["timeout_s"])
            done += 1
        except Exception as exc:
            return {"ok": False, "type": type(exc).__name__, "error": str(exc), "done": done,
                    "elapsed_s": time.monotonic() - start_s}


def _run_parallel(transport: Any, ops: list[dict], device: str) -> list[dict]:
    results: list[dict] = [{} for _ in ops]

    def run(i: int) -> None:
        results[i] = _run_op(transport, ops[i], device)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(ops))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REPLY_TIMEOUT_S)
    return results


def _agent_main(conn: Any, store_host: str, store_port: int, device: str) -> None:
    from kvtransfer.torch_dist import TorchDistTransport

    torch.set_num_threads(1)  # two agents' OpenMP pools spinning on 2 cores starve gloo's IO threads
    transport = None
    while True:
        command = conn.recv()
        if command[0] == "exit":
            return
        if command[0] == "init":
            if transport is not None:
                transport.close()
            local_id, kwargs = command[1], command[2]
            transport = TorchDistTransport(local_id, store_host, store_port, **kwargs)
            conn.send([{"ok": True}])
            continue
        results = []
        for op in command[1]:
            results.append(_run_op(transport, op, device))
            if not results[-1]["ok"]:
                break  # later ops of a run assume the earlier ones worked
        try:
            conn.send(results)
        except Exception:
            conn.send([{"ok": False, "type": "PickleError", "error": traceback.format_exc()}])


class Agent:
    """Handle on one worker process; every wait on it is bounded."""

    def __init__(self, name: str, store_host: str, store_port: int, device: str) -> None:
        self.name = name
        self.device = device
        self._conn, child = _SPAWN.Pipe()
        self.process = _SPAWN.Process(target=_agent_main, args=(child, store_host, store_port, device), daemon=True)
        self.process.start()
        self.local_id = ""

    def init(self, local_id: str, **kwargs: Any) -> None:
        """Give the agent a fresh transport named ``local_id`` (closing its previous one)."""
        self.local_id = local_id
        self._conn.send(("init", local_id, kwargs))
        self.result()

    def start(self, *ops: dict) -> None:
        self._conn.send(("run", list(ops)))

    def result(self, timeout_s: float = REPLY_TIMEOUT_S) -> list[dict]:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"agent {self.name} gave no answer within {timeout_s} s (hung?)")
        return self._conn.recv()

    def run(self, *ops: dict) -> list[dict]:
        self.start(*ops)
        return self.result()

    def kill(self) -> None:
        """SIGKILL this agent's own process (by its PID), then reap it."""
        self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("exit",))
            except OSError:
                pass
            self.process.join(5)
        if self.process.is_alive():
            self.kill()


class Cluster:
    """The rendezvous store plus long-lived agents; ``spawn`` adds short-lived ones (to kill)."""

    def __init__(self, backend: str, devices: dict[str, str]) -> None:
        from kvtransfer.store import create_rendezvous_store

        self.backend = backend
        self.rendezvous = create_rendezvous_store()
        self._devices = devices
        self._test_count = 0
        self.agents = {name: self.spawn(name) for name in devices if name != "victim"}

    def spawn(self, name: str) -> Agent:
        return Agent(name, self.rendezvous.host, self.rendezvous.port, self._devices[name])

    def fresh_ids(self, **max_pairs: int) -> dict[str, Agent]:
        """Give every agent a transport with a never-used id (optionally a max_pairs per agent)."""
        self._test_count += 1
        for name, agent in self.agents.items():
            kwargs = {"backend": self.backend, "connect_timeout_s": 10.0, "max_pairs": max_pairs.get(name, 16)}
            agent.init(f"{name}-t{self._test_count}", **kwargs)
        return self.agents

    def stop(self) -> None:
        for agent in self.agents.values():
            agent.stop()


# Contract runs: (backend every agent asks for, agent name -> device). For nccl, "b" is the hub every
# test talks through: it alone sits on cuda:1, so no pair ever has both ranks on one GPU (NCCL refuses
# that). "same-gpu": every agent on cuda:0 with backend auto, which agrees on cuda_ipc for each pair.
_NAMES = ("a", "b", "c", "victim")
CONTRACT_RUNS = {
    "gloo": ("gloo", {name: "cpu" for name in _NAMES}, 0),
    "nccl": ("nccl", {name: "cuda:1" if name == "b" else "cuda:0" for name in _NAMES}, 2),
    "same-gpu": ("auto", {name: "cuda:0" for name in _NAMES}, 1),
}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=[pytest.mark.cuda] if gpus else [])
                                        for name, (_, _, gpus) in CONTRACT_RUNS.items()])
def cluster(request: pytest.FixtureRequest):
    backend, devices, gpus_needed = CONTRACT_RUNS[request.param]
    if torch.cuda.device_count() < gpus_needed:
        pytest.skip(f"the {request.param} contract run needs {gpus_needed} CUDA device(s); "
                    f"found {torch.cuda.device_count()}")
    cluster = Cluster(backend, devices)
    yield cluster
    cluster.stop()
