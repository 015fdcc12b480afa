"""What a streamed token costs through `splitserve serve`: TPOT, output tok/s and CPU per token by process.

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.bench_token_path [--arm LABEL=CHECKOUT ...] \
        [--concurrency 1,16] [--rounds 3] [--json docs/perf/token_path/cpu.json]

Each arm is one `splitserve serve` P1D1 cluster (one prefill worker, one decode instance, `--threads` torch
threads each, prefix caching off) over the trained model of `benchmarks/trained_model.py`, serving the code of a
checkout (default: this one, labelled `current`). Several `--arm`s compare checkouts of the repository in one run
(say, a worktree of the previous commit against the working tree): every arm joins the one Ray cluster this
process starts, as its own Ray job whose workers import that checkout first (`PYTHONPATH` in the job's
runtime environment). All arms stay up; each round runs every concurrency on every arm, the arms' order
alternating per round, with fresh prompts per round.

Per arm, concurrency and round: `max(4, 2 x C)` streamed `POST /v1/completions` with C in flight (token-id
prompts of `--min-prompt`-`--max-prompt` tokens, `--output` tokens, temperature 0, `ignore_eos`), through the
`splitserve bench --backend openai` client. Output tok/s = output tokens / wall time of the burst; TPOT =
(last chunk - first chunk) / (tokens - 1) per stream, p50 over the round's streams. CPU per token = the CPU
time (user + system, every thread) that the arm's router process (the `serve` process), its decode instance
and its prefill worker used during the burst, divided by the tokens it streamed: on a shared machine a wall
time moves with the neighbours' load, the CPU a token costs much less. Before the rounds, `--idle-s` seconds
with nothing in flight give each arm's background CPU per second. Each round also runs every arm's engine
alone, in a subprocess on that checkout (`ENGINE_STEP`): the CPU time of a decode step at batch 1 and 8 and
the greedy tokens, which must be equal across arms. Medians over the rounds; `x_first_arm` is an arm's
median over the first arm's, paired per round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

from benchmarks.bench_llamacpp_server import READY_TIMEOUT_S, REQUEST_TIMEOUT_S, Server, _burst, _free_port
from benchmarks.bench_quant_perplexity import cpu_name
from benchmarks.bench_quant_throughput import _requests
from benchmarks.trained_model import ensure_trained_model

REPO = Path(__file__).resolve().parent.parent
ARM_ENV = "SPLITSERVE_BENCH_ARM"  # in each arm's worker processes: tells whose CPU time is whose
# Ray reads a job's config (its runtime environment here) from this variable when the driver connects.
RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
ROLES = ("router", "decode", "prefill")
ENGINE_BATCHES = (1, 8)
# Run in a subprocess with an arm's checkout first on sys.path: the engine's decode step alone, in
# process, one torch thread, CPU time of the stepping thread per step (the median of a request's decode
# steps), and the greedy tokens of the first request (every arm must give the same).
ENGINE_STEP = """
import json, statistics, sys, time, torch
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
model_dir, batches, output = sys.argv[1], [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3])
torch.set_num_threads(1)
engine = LLMEngine(EngineConfig(model_dir=model_dir, num_threads=1, enable_prefix_caching=False, num_kv_blocks=512))
result = {}
for batch in [1] + batches:
    for i in range(batch):
        params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
        engine.add_request(f"{batch}-{i}", list(range(5, 45 + i)), params)
    engine.step()
    cpu_s, tokens = [], []
    while engine.has_unfinished():
        started = time.thread_time()
        updates = engine.step()
        cpu_s.append(time.thread_time() - started)
        tokens += [t for u in updates if u.seq_id == f"{batch}-0" for t in u.new_token_ids]
    for i in range(batch):
        engine.seqs.pop(f"{batch}-{i}", None)
    result[str(batch)] = {"step_cpu_ms": statistics.median(cpu_s) * 1e3, "tokens": tokens}
print(json.dumps(result))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arm", action="append", default=[], help="LABEL=CHECKOUT: serve that checkout's code (repeatable)"
    )
    parser.add_argument("--concurrency", default="1,16", help="requests in flight, comma-separated")
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trained-steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds of the idle CPU measurement")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    arms = {}
    for spec in args.arm or [f"current={REPO}"]:
        label, sep, path = spec.partition("=")
        if not (label and sep and path) or not (Path(path) / "splitserve" / "cli.py").is_file():
            parser.error(f"--arm: {spec!r} is not LABEL=CHECKOUT of this repository")
        arms[label] = str(Path(path).resolve())
    args.arms = arms
    try:
        args.levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency: {args.concurrency!r} is not a comma-separated list of integers")
    if not args.levels or min(args.levels) < 1:
        parser.error("--concurrency: every level must be >= 1")
    if args.output < 2:
        parser.error("--output: must be >= 2 (a first token, then at least one more for TPOT)")
    if args.rounds < 1:
        parser.error("--rounds: must be >= 1")
    if args.idle_s <= 0:
        parser.error("--idle-s: must be > 0")
    return args


def start_arm(args: argparse.Namespace, label: str, checkout: str, model_dir: str, address: str, workdir: Path):
    port = _free_port()
    pool = {"threads": args.threads, "num_cpus": 0.5, "max_num_seqs": max(args.levels), "num_kv_blocks": 1024}
    config = {
        "enable_prefix_caching": False,  # every prompt is new: no arm gains from an earlier round's KV
        "prefill": pool,
        "decode": pool,
        "ready_timeout_s": READY_TIMEOUT_S,
        "request_timeout_s": REQUEST_TIMEOUT_S,
    }
    path = workdir / f"{label}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    command = [
        sys.executable,
        *("-m", "splitserve.cli", "serve", "--config", str(path), "--model", model_dir),
        *("--ray-address", address, "--cluster-name", f"bench-{label}"),
        *("--host", "127.0.0.1", "--port", "0", "--http-port", str(port), "--log-level", "warning"),
    ]
    env_vars = {"PYTHONPATH": checkout, ARM_ENV: label, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env = {**os.environ, **env_vars, RAY_JOB_CONFIG_ENV: json.dumps({"runtime_env": {"env_vars": env_vars}})}
    return Server(f"splitserve {label}", command, port, "/v1/models", workdir / f"{label}.log", env=env, cwd=checkout)


def cpu_by_role(servers: dict[str, Server]) -> dict[str, dict[str, float]]:
    """CPU seconds so far of each arm's router, decode instance and prefill worker processes."""
    out = {label: dict.fromkeys(ROLES, 0.0) for label in servers}
    routers = {server.process.pid: label for label, server in servers.items()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            if int(pid) in routers:
                label, role = routers[int(pid)], "router"
            elif command.startswith((b"ray::DecodeRank", b"ray::PrefillWorker")):
                with open(f"/proc/{pid}/environ", "rb") as f:
                    marks = [v for v in f.read().split(b"\0") if v.startswith(ARM_ENV.encode() + b"=")]
                if not marks:
                    continue
                label = marks[0].split(b"=", 1)[1].decode()
                role = "decode" if command.startswith(b"ray::DecodeRank") else "prefill"
            else:
                continue
        except OSError:
            continue  # ended meanwhile
        if label in out:
            out[label][role] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def idle_cpu(servers: dict[str, Server], seconds: float) -> dict[str, dict[str, float]]:
    """CPU milliseconds per second each arm's processes use with no request in flight: background
    loops (prefix-index pulls, health probes, membership), which a token pays for on a full machine."""
    before, started_s = cpu_by_role(servers), time.monotonic()
    time.sleep(seconds)
    after, elapsed_s = cpu_by_role(servers), time.monotonic() - started_s
    idle = {
        label: {role: (after[label][role] - before[label][role]) / elapsed_s * 1e3 for role in ROLES}
        for label in servers
    }
    for label, row in idle.items():
        print(f"idle {label:>12}: " + ", ".join(f"{role} {ms:.1f}" for role, ms in row.items()) + " CPU ms/s")
    return idle


def engine_step(checkout: str, model_dir: str, output: int) -> dict:
    """The in-process decode step of `checkout`'s engine (ENGINE_STEP), per batch size."""
    env = {**os.environ, "PYTHONPATH": checkout}
    batches = ",".join(map(str, ENGINE_BATCHES))
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_STEP, model_dir, batches, str(output)],
        env=env,
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=REQUEST_TIMEOUT_S,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"engine step of {checkout}: exit {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = str(ensure_trained_model(steps=args.trained_steps))
    workdir = Path(tempfile.mkdtemp(prefix="bench-token-path-"))
    ray.init(num_cpus=16, include_dashboard=False, configure_logging=False)
    servers: dict[str, Server] = {}
    try:
        address = ray.get_runtime_context().gcs_address
        for label, checkout in args.arms.items():
            servers[label] = start_arm(args, label, checkout, model_dir, address, workdir)
            servers[label].wait_ready(time.monotonic() + READY_TIMEOUT_S)  # one start at a time on 2 cores
        report = measure(args, model_dir, servers)
    finally:
        for server in servers.values():
            server.stop()
        ray.shutdown()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def measure(args: argparse.Namespace, model_dir: str, servers: dict[str, Server]) -> dict:
    labels = list(servers)
    for label in labels:  # warm-up (first requests size buffers, load lazily): not measured
        asyncio.run(_burst(servers[label], [[5, 6, 7, 8]] * 2, 4, 2))
    idle = idle_cpu(servers, args.idle_s)
    runs: dict[int, dict[str, list[dict]]] = {c: {label: [] for label in labels} for c in args.levels}
    steps: dict[str, list[dict]] = {label: [] for label in labels}
    loads: list[float] = []
    for round_index in range(args.rounds):
        for level in args.levels:
            count = max(4, 2 * level)
            prompts = _requests(model_dir, count, args.min_prompt, args.max_prompt, args.seed + 1000 * round_index)
            for label in labels if round_index % 2 == 0 else labels[::-1]:
                before = cpu_by_role(servers)[label]
                got = asyncio.run(_burst(servers[label], prompts, args.output, level))
                after = cpu_by_role(servers)[label]
                tokens = count * args.output
                got.update({f"{role}_cpu_ms_per_token": (after[role] - before[role]) / tokens * 1e3 for role in ROLES})
                got["cpu_ms_per_token"] = sum(got[f"{role}_cpu_ms_per_token"] for role in ROLES)
                runs[level][label].append(got)
        for label in labels if round_index % 2 == 0 else labels[::-1]:
            steps[label].append(engine_step(args.arms[label], model_dir, args.output))
        loads.append(os.getloadavg()[0])
        print(f"round {round_index + 1}/{args.rounds} done, load average (1 min) {loads[-1]:.1f}", flush=True)
    results: dict[str, dict] = {}
    for level, by_arm in runs.items():
        keys = [k for k in by_arm[labels[0]][0] if k != "ttft_p50_ms"]
        rows = {label: {k: statistics.median(r[k] for r in rs) for k in keys} for label, rs in by_arm.items()}
        for label, row in rows.items():
            for key in ("output_tok_s", "tpot_p50_ms", "cpu_ms_per_token"):
                ratios = [r[key] / b[key] for r, b in zip(by_arm[label], by_arm[labels[0]], strict=True)]
                row[f"{key}_x_first_arm_per_round"] = ratios
                row[f"{key}_x_first_arm"] = statistics.median(ratios)
            print(
                f"in flight {level:3d}  {label:>12}: {row['output_tok_s']:7.1f} tok/s  TPOT p50 "
                f"{row['tpot_p50_ms']:6.2f} ms  CPU {row['cpu_ms_per_token']:5.2f} ms/token (router "
                f"{row['router_cpu_ms_per_token']:.2f}, decode {row['decode_cpu_ms_per_token']:.2f}, prefill "
                f"{row['prefill_cpu_ms_per_token']:.2f})  x tok/s {row['output_tok_s_x_first_arm']:.2f}",
                flush=True,
            )
        results[str(level)] = rows
    engine = engine_summary(steps, labels)
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "arm", "arms", "levels")}
    return {
        "machine": cpu_name(),
        "cores": len(os.sched_getaffinity(0)),
        "versions": {"torch": torch.__version__},
        "model": Path(model_dir).name,
        "settings": settings,
        "arms": labels,
        "topology": "splitserve serve: P1D1 (one prefill worker, one decode instance) per arm, one Ray",
        "load_average_1min_per_round": loads,
        "idle_cpu_ms_per_s": idle,
        "results": results,
        "engine_step": engine,
    }


def engine_summary(steps: dict[str, list[dict]], labels: list[str]) -> dict:
    """Median step CPU per arm and batch, paired ratios against the first arm, and whether every arm and
    round gave the first arm's greedy tokens."""
    first = steps[labels[0]][0]
    out: dict = {"tokens_equal_across_arms_and_rounds": True}
    for label, rounds in steps.items():
        row = {}
        for batch in map(str, ENGINE_BATCHES):
            cpu = [r[batch]["step_cpu_ms"] for r in rounds]
            paired = zip(rounds, steps[labels[0]], strict=True)
            ratios = [r[batch]["step_cpu_ms"] / b[batch]["step_cpu_ms"] for r, b in paired]
            row[batch] = {
                "step_cpu_ms": statistics.median(cpu),
                "step_cpu_ms_x_first_arm_per_round": ratios,
                "step_cpu_ms_x_first_arm": statistics.median(ratios),
            }
            if any(r[batch]["tokens"] != first[batch]["tokens"] for r in rounds):
                out["tokens_equal_across_arms_and_rounds"] = False
            print(
                f"engine step, batch {batch:>2} {label:>12}: {row[batch]['step_cpu_ms']:.3f} ms CPU "
                f"(x {row[batch]['step_cpu_ms_x_first_arm']:.3f} the first arm)",
                flush=True,
            )
        out[label] = row
    print(f"greedy tokens equal across arms and rounds: {out['tokens_equal_across_arms_and_rounds']}")
    return out


if __name__ == "__main__":
    main()
