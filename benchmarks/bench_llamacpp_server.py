"""Server against server: llama.cpp's `llama-server` (GGUF F32 / Q8_0 / Q4_0, `--parallel` slots) and `splitserve
serve` (fp32 / int8 / int4, continuous batching), both over HTTP, driven by the same OpenAI client.

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.bench_llamacpp_server --llama-server BUILD/bin/llama-server \
        --llamacpp-python LLAMACPP_VENV/bin/python --converter LLAMA_CPP/convert_hf_to_gguf.py \
        [--rounds 3] [--json docs/perf/llamacpp_server/cpu.json]

`llama-server` is built once from the llama.cpp that the llama-cpp-python sdist vendors (the same source as
`bench_llamacpp`'s in-process peer; neither is a dependency of this repository), CPU only:

    cmake -S LLAMA_CPP -B BUILD -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build BUILD --config Release -j2 --target llama-server

The GGUF files are made as `bench_llamacpp` makes them (its `prepare_gguf`: F32 by llama.cpp's converter,
Q8_0 and Q4_0 by `llama_model_quantize` in the llama-cpp-python venv); `--gguf-dir` reuses them.

The servers: one `llama-server` per GGUF on 127.0.0.1 (`--parallel C` slots, one KV stream each, a context of
C x (max prompt + output + 16) cells, `--threads` for decode and batch, prompt caching and its RAM cache off),
and one `splitserve serve` per weight kind, each a P1D1 cluster (one prefill worker, one decode instance, every
worker with `--threads` torch threads, prefix caching off) in one Ray cluster that this process starts. P1D1 is
the smallest cluster `splitserve serve` runs: there is no colocated serving mode, prefill and decode are always
separate workers, so a prompt's KV crosses the hand-off here as it does in production. All six stay up; the
arms alternate order per round (`--rounds`), each round with fresh prompts (`--seed` + round: no server can
reuse a previous round's KV) and the median kept, so drift on a shared machine hits every arm alike.

Per arm and round: C concurrent streamed `POST /v1/completions` (token-id prompts, uniform lengths in
[--min-prompt, --max-prompt], `max_tokens` --output, temperature 0, `ignore_eos`), then `--batch1-requests`
requests one at a time. The client is `loadtest.openai_backend.OpenAIBackend`, the `splitserve bench --backend
openai` client, for both servers. Output tok/s = output tokens / wall time of the burst (first send to last
token); TTFT from send to the first chunk with text; TPOT = (last chunk - first chunk) / (tokens - 1) per
stream; p50 over the streams of a round, then the median over rounds. Greedy agreement: the completion texts of
`--agreement-prompts` prompts (windows of the corpus the model was trained on), non-streamed, from splitserve
fp32 and llama-server F32 against HF `generate`'s tokens decoded by the checkpoint's tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from benchmarks.bench_llamacpp import add_checkpoint_args, hf_greedy, prepare_gguf
from benchmarks.bench_quant_perplexity import cpu_name
from benchmarks.bench_quant_throughput import _requests
from benchmarks.trained_model import ensure_trained_model
from engine.demo_model import corpus_text
from engine.tokenizer import load_tokenizer
from loadtest.backends import RequestOptions
from loadtest.openai_backend import OpenAIBackend
from loadtest.plan import PlannedRequest

READY_TIMEOUT_S = 900.0  # a P1D1 start on a loaded 2-core machine: Ray workers, model load, warm-up
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Arm:
    """One server: `splitserve` with `kind` its `quantization`, or `llama.cpp` with `kind` the GGUF file type."""

    name: str
    side: str
    kind: str


# Paired by weight width; Q8_0 and Q4_0 scale blocks of 32 weights, splitserve's int8 per output channel and int4
# groups of 128 (the defaults of `quantization`).
ARMS: tuple[Arm, ...] = (
    Arm("splitserve fp32", "splitserve", "none"),
    Arm("llama-server F32", "llama.cpp", "F32"),
    Arm("splitserve int8", "splitserve", "int8"),
    Arm("llama-server Q8_0", "llama.cpp", "Q8_0"),
    Arm("splitserve int4 g128", "splitserve", "int4"),
    Arm("llama-server Q4_0", "llama.cpp", "Q4_0"),
)
BASELINE = ARMS[0].name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True, help="the llama-server binary (build: see the docstring)")
    parser.add_argument(
        "--llamacpp-python", default=None, help="python of a venv with llama-cpp-python (quantizes the GGUF files)"
    )
    add_checkpoint_args(parser)
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (llama-server's slots)")
    parser.add_argument("--batch1-requests", type=int, default=4, help="requests sent one at a time per round")
    parser.add_argument("--agreement-prompts", type=int, default=4, help="prompts of the greedy text check")
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if not os.access(args.llama_server, os.X_OK):
        parser.error(f"--llama-server: {args.llama_server} is not an executable file")
    if args.output < 2:
        parser.error("--output: must be >= 2 (a first token, then at least one more for TPOT)")
    if not 1 <= args.min_prompt <= args.max_prompt <= 256:
        parser.error("--min-prompt/--max-prompt: need 1 <= min <= max <= 256")
    for flag in ("concurrency", "batch1_requests", "rounds", "agreement_prompts"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be >= 1")
    return args


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server subprocess with its log file; `url` answers once `ready_path` returns 200."""

    def __init__(
        self,
        name: str,
        command: list[str],
        port: int,
        ready_path: str,
        log: Path,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.name, self.url, self.log = name, f"http://127.0.0.1:{port}", log
        self.ready_path = ready_path
        with log.open("w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        self.model = ""

    def wait_ready(self, deadline_s: float) -> None:
        while time.monotonic() < deadline_s:
            if self.process.poll() is not None:
                raise SystemExit(f"{self.name}: exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as reply:
                    if reply.status == 200:
                        cards = json.loads(urllib.request.urlopen(self.url + "/v1/models", timeout=5).read())
                        self.model = cards["data"][0]["id"]
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise SystemExit(f"{self.name}: not ready within {READY_TIMEOUT_S:.0f} s (log: {self.log})")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


def start_llama_server(args: argparse.Namespace, kind: str, gguf: str, workdir: Path) -> Server:
    port = _free_port()
    cells = args.max_prompt + args.output + 16
    command = [
        args.llama_server,
        *("-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-ngl", "0"),
        *("--parallel", str(args.concurrency), "--ctx-size", str(args.concurrency * cells)),
        *("--threads", str(args.threads), "--threads-batch", str(args.threads)),
        # One KV stream per slot (as bench_llamacpp's batch API); no prompt reuse across requests, as on our side.
        *("--no-kv-unified", "--no-cache-prompt", "--cache-ram", "0", "--no-webui"),
    ]
    return Server(f"llama-server {kind}", command, port, "/health", workdir / f"llama-server-{kind}.log")


def start_splitserve(
    args: argparse.Namespace, quantization: str, model_dir: str, ray_address: str, workdir: Path
) -> Server:
    port = _free_port()
    pool = {
        "threads": args.threads,
        "num_cpus": 0.5,
        "max_num_seqs": args.concurrency,
        "num_kv_blocks": 1024,
    }
    config = {
        "quantization": quantization,
        "enable_prefix_caching": False,  # every request is new to the server, as on llama-server's side
        "prefill": pool,
        "decode": pool,
        "ready_timeout_s": READY_TIMEOUT_S,
        "request_timeout_s": REQUEST_TIMEOUT_S,
    }
    path = workdir / f"splitserve-{quantization}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    command = [
        sys.executable,
        *("-m", "splitserve.cli", "serve", "--config", str(path), "--model", model_dir),
        *("--ray-address", ray_address, "--cluster-name", f"bench-{quantization}"),
        *("--host", "127.0.0.1", "--port", "0", "--http-port", str(port), "--log-level", "warning"),
    ]
    return Server(f"splitserve {quantization}", command, port, "/v1/models", workdir / f"splitserve-{quantization}.log")


async def _stream(backend: OpenAIBackend, index: int, prompt: list[int], output: int) -> dict:
    planned = PlannedRequest(index, 0.0, tuple(prompt), output)
    options = RequestOptions(f"bench-{index}-{time.monotonic_ns()}", 0.0, REQUEST_TIMEOUT_S)
    sent_s = time.perf_counter()
    chunk_s: list[float] = []
    counted = 0
    reported: int | None = None
    async for event in backend.stream(planned, options):
        if event.num_tokens:
            chunk_s.append(time.perf_counter())
            counted += event.num_tokens
        if event.completion_tokens is not None:
            reported = event.completion_tokens
    tokens = reported if reported is not None else counted
    if tokens != output or not chunk_s:
        raise SystemExit(f"{backend.base}: a stream gave {tokens} tokens, asked {output} with ignore_eos")
    return {
        "sent_s": sent_s,
        "last_s": chunk_s[-1],
        "tokens": tokens,
        "ttft_s": chunk_s[0] - sent_s,
        "tpot_s": (chunk_s[-1] - chunk_s[0]) / (tokens - 1),
    }


async def _burst(server: Server, prompts: list[list[int]], output: int, concurrency: int) -> dict:
    """`prompts` sent with `concurrency` in flight; the round's figures."""
    gate = asyncio.Semaphore(concurrency)
    async with OpenAIBackend(server.url, None, REQUEST_TIMEOUT_S, model=server.model) as backend:

        async def one(index: int, prompt: list[int]) -> dict:
            async with gate:
                return await _stream(backend, index, prompt, output)

        streams = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall_s = max(s["last_s"] for s in streams) - min(s["sent_s"] for s in streams)
    return {
        "output_tok_s": sum(s["tokens"] for s in streams) / wall_s,
        "ttft_p50_ms": statistics.median(s["ttft_s"] for s in streams) * 1e3,
        "tpot_p50_ms": statistics.median(s["tpot_s"] for s in streams) * 1e3,
    }


def _complete(server: Server, prompt: list[int], output: int) -> str:
    """One non-streamed greedy completion's text."""
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": output,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        server.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
        return json.loads(reply.read())["choices"][0]["text"]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or str(ensure_trained_model(steps=args.trained_steps))
    workdir = Path(tempfile.mkdtemp(prefix="bench-llamacpp-server-"))
    if args.llamacpp_python is None and not all(
        (Path(args.gguf_dir or workdir) / f"model-{k}.gguf").exists() for k in ("Q8_0", "Q4_0")
    ):
        raise SystemExit("--llamacpp-python: needed to quantize the GGUF files (or a --gguf-dir that has them)")
    gguf = prepare_gguf(model_dir, args, Path(args.gguf_dir or workdir))
    ray.init(
        num_cpus=16,  # logical: room for three clusters' actors; the threads they run are what is measured
        include_dashboard=False,
        configure_logging=False,
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    servers: dict[str, Server] = {}
    try:
        address = ray.get_runtime_context().gcs_address
        for arm in ARMS:
            if arm.side == "llama.cpp":
                servers[arm.name] = start_llama_server(args, arm.kind, gguf[arm.kind], workdir)
            else:
                servers[arm.name] = start_splitserve(args, arm.kind, model_dir, address, workdir)
                # One cluster start at a time: three at once on two cores time out their warm-ups.
                servers[arm.name].wait_ready(time.monotonic() + READY_TIMEOUT_S)
        for server in servers.values():
            server.wait_ready(time.monotonic() + READY_TIMEOUT_S)
        report = _measure(args, model_dir, servers)
    finally:
        for server in servers.values():
            server.stop()
        ray.shutdown()
    report["gguf_bytes"] = {kind: os.path.getsize(path) for kind, path in gguf.items()}
    shutil.rmtree(workdir, ignore_errors=True)  # the servers' logs and configs; kept when a start fails
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _measure(args: argparse.Namespace, model_dir: str, servers: dict[str, Server]) -> dict:
    for arm in ARMS:  # warm-up (first requests size buffers, load lazily): not measured
        asyncio.run(_burst(servers[arm.name], [[5, 6, 7, 8]] * 2, 4, 2))
    modes = {"concurrent": args.concurrency, "batch1": 1}
    runs: dict[str, dict[str, list[dict]]] = {mode: {arm.name: [] for arm in ARMS} for mode in modes}
    loads: list[float] = []
    for round_index in range(args.rounds):
        seed = args.seed + 1000 * round_index
        prompts = {
            "concurrent": _requests(model_dir, args.concurrency, args.min_prompt, args.max_prompt, seed),
            "batch1": _requests(model_dir, args.batch1_requests, args.min_prompt, args.max_prompt, seed + 1),
        }
        for arm in ARMS if round_index % 2 == 0 else ARMS[::-1]:
            for mode, in_flight in modes.items():
                got = asyncio.run(_burst(servers[arm.name], prompts[mode], args.output, in_flight))
                runs[mode][arm.name].append(got)
        loads.append(os.getloadavg()[0])
        print(f"round {round_index + 1}/{args.rounds} done, load average (1 min) {loads[-1]:.1f}", flush=True)
    keys = ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms")
    results = {
        mode: {name: {key: statistics.median(r[key] for r in rs) for key in keys} for name, rs in by_arm.items()}
        for mode, by_arm in runs.items()
    }
    for mode, result in results.items():
        base = [r["output_tok_s"] for r in runs[mode][BASELINE]]
        for name, row in result.items():
            rounds = [r["output_tok_s"] for r in runs[mode][name]]
            row["output_tok_s_x_splitserve_fp32"] = row["output_tok_s"] / result[BASELINE]["output_tok_s"]
            # Per round against the same round's fp32: their spread is the run's noise.
            ratios = [arm / fp32 for arm, fp32 in zip(rounds, base, strict=True)]
            row["output_tok_s_x_splitserve_fp32_per_round"] = ratios
            row["output_tok_s_x_splitserve_fp32_paired"] = statistics.median(ratios)
        _print(mode, result, args)
    agreement = _agreement(args, model_dir, servers)
    print(f"greedy text equal to HF generate, of {args.agreement_prompts} prompts: {agreement['equal_to_hf']}")
    settings = {
        k: v
        for k, v in vars(args).items()
        if k not in ("json", "model", "llamacpp_python", "converter", "gguf_dir", "llama_server")
    }
    return {
        "machine": cpu_name(),
        "cores": len(os.sched_getaffinity(0)),
        "versions": {"torch": torch.__version__, "llama_server": _llama_version(args.llama_server)},
        "model": Path(model_dir).name,
        "settings": settings,
        "topology": "splitserve serve: P1D1 (one prefill worker, one decode instance) per weight kind, one Ray",
        "load_average_1min_per_round": loads,
        "results": results,
        "greedy_agreement": agreement,
    }


def _agreement(args: argparse.Namespace, model_dir: str, servers: dict[str, Server]) -> dict:
    # Windows of the corpus the model was trained on as prompts, so its greedy continuations are words (a random
    # token prompt mostly gives newlines, which two servers could agree on by chance).
    tokenizer = load_tokenizer(model_dir)
    corpus = tokenizer(corpus_text())["input_ids"]
    step = max(1, (len(corpus) - args.max_prompt) // args.agreement_prompts)
    names = (BASELINE, "llama-server F32")
    prompts = []
    for start in range(0, step * args.agreement_prompts, step):
        prompt = corpus[start : start + args.max_prompt]
        reference_text = tokenizer.decode(hf_greedy(model_dir, prompt, args.output))
        texts = {name: _complete(servers[name], prompt, args.output) for name in names}
        prompts.append(
            {
                "prompt_tokens": len(prompt),
                "hf_generate_text": reference_text,
                "servers": {
                    name: {
                        "text": text,
                        "equal_to_hf": text == reference_text,
                        "common_prefix_chars_with_hf": _common_chars(text, reference_text),
                    }
                    for name, text in texts.items()
                },
            }
        )
    return {
        "equal_to_hf": {name: sum(p["servers"][name]["equal_to_hf"] for p in prompts) for name in names},
        "prompts": prompts,
    }


def _common_chars(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _llama_version(binary: str) -> str:
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60, check=False)
    return (done.stdout + done.stderr).strip().splitlines()[0] if (done.stdout + done.stderr).strip() else "unknown"


def _print(mode: str, result: dict, args: argparse.Namespace) -> None:
    in_flight = args.concurrency if mode == "concurrent" else 1
    requests = args.concurrency if mode == "concurrent" else args.batch1_requests
    print(
        f"\n{mode}: {requests} requests, {in_flight} in flight, prompts {args.min_prompt}-{args.max_prompt}, "
        f"{args.output} output tokens each, {args.threads} threads, median of {args.rounds} rounds"
    )
    header = f"{'output tok/s':>14}{'x fp32':>8}{'paired':>8}{'range':>13}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}"
    print(f"{'arm':<24}{header}")
    for name, row in result.items():
        ratios = row["output_tok_s_x_splitserve_fp32_per_round"]
        print(
            f"{name:<24}{row['output_tok_s']:>14.1f}{row['output_tok_s_x_splitserve_fp32']:>8.2f}"
            f"{row['output_tok_s_x_splitserve_fp32_paired']:>8.2f}{f'{min(ratios):.2f}-{max(ratios):.2f}':>13}"
            f"{row['ttft_p50_ms']:>13.1f}{row['tpot_p50_ms']:>13.2f}"
        )


if __name__ == "__main__":
    main()
