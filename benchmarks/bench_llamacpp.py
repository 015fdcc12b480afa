"""A CPU peer side by side: llama.cpp (GGUF F32 / Q8_0 / Q4_0) against the engine (fp32 / int8 / int4), same run.

`python -m benchmarks.bench_llamacpp --llamacpp-python VENV/bin/python --converter LLAMA_CPP/convert_hf_to_gguf.py`.

The checkpoint is the trained small model of `benchmarks/trained_model.py` (`--model DIR` for another). llama.cpp
runs in a separate venv that has `llama-cpp-python` (never a dependency of this repository): its python
(`--llamacpp-python`) runs `benchmarks/llamacpp_worker.py`, which this process drives over a pipe. The GGUF
files are written by llama.cpp's own converter (`--converter`, the `convert_hf_to_gguf.py` that the
llama-cpp-python sdist vendors, run with this venv's torch and the converter's own `gguf-py`) as F32, then
quantized to Q8_0 and Q4_0 by llama.cpp's `llama_model_quantize`.

Both sides get the same token-id prompts (uniform lengths in [--min-prompt, --max-prompt]), `--output` tokens
each, greedy, EOS ignored, `--threads` threads. For each batch size B, B requests run together: the engine's
continuous batching with max_num_seqs=B; llama.cpp's batch API with B sequences decoding in one batch per step
(as its server's parallel slots do). Decode tok/s = tokens of decode-only steps / their time; output tok/s =
all output tokens / wall time, prefill included. The arms alternate order per round (`--rounds`) and the
median is kept, so drift on a shared machine hits both sides alike. Greedy tokens of the first prompt at
batch 1 are compared: engine fp32 and llama.cpp F32 against HF `generate`. `bench_llamacpp_server` compares the
servers themselves (`llama-server`'s slots and `splitserve serve`) over HTTP.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from transformers import LlamaForCausalLM

from benchmarks.bench_quant_perplexity import cpu_name
from benchmarks.bench_quant_throughput import _requests
from benchmarks.trained_model import ensure_trained_model
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

WORKER = Path(__file__).with_name("llamacpp_worker.py")


@dataclass(frozen=True)
class Arm:
    """One side's configuration: `engine` keys for EngineConfig, or `gguf` the llama.cpp file type."""

    name: str
    engine: dict[str, Any] | None = None
    gguf: str | None = None


# Paired by weight width; Q8_0 and Q4_0 scale blocks of 32 weights, the engine's group-wise kinds groups of 128.
ARMS: tuple[Arm, ...] = (
    Arm("engine fp32", engine={}),
    Arm("llama.cpp F32", gguf="F32"),
    Arm("engine int8 per channel", engine={"quantization": "int8"}),
    Arm("engine int8 g128", engine={"quantization": "int8", "quantization_group_size": 128}),
    Arm("llama.cpp Q8_0", gguf="Q8_0"),
    Arm("engine int4 g128", engine={"quantization": "int4"}),
    Arm("llama.cpp Q4_0", gguf="Q4_0"),
)

# The converter identifies a BPE pre-tokenizer by hashing its output on a fixed text and refuses hashes it does
# not list; the trained model's tokenizer is byte-level BPE with GPT-2's split pattern, so it is declared as
# "gpt-2" (prompts go to llama.cpp as token ids, so its tokenizer is never used here). The sentencepiece path,
# tried first, is skipped: the checkpoint has no tokenizer.model.
CONVERT = """
import runpy, sys
converter = sys.argv.pop(1)
sys.path.insert(0, str(__import__("pathlib").Path(converter).parent))
from conversion import base
def _no_sentencepiece(self, add_to_gguf=True):
    raise FileNotFoundError("tokenizer.model")
base.TextModel._set_vocab_sentencepiece = _no_sentencepiece
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = converter
runpy.run_path(converter, run_name="__main__")
"""


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    """The checkpoint and its GGUF files: the flags every llama.cpp comparison takes."""
    parser.add_argument(
        "--converter", default=None, help="llama.cpp's convert_hf_to_gguf.py (unless --gguf-dir has the files)"
    )
    parser.add_argument(
        "--gguf-dir", default=None, help="GGUF files are written (or found) here; default: a temporary folder"
    )
    parser.add_argument("--model", default=None, help="checkpoint directory (default: benchmarks/trained_model.py's)")
    parser.add_argument("--trained-steps", type=int, default=60)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llamacpp-python", required=True, help="python of a venv with llama-cpp-python")
    add_checkpoint_args(parser)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.output < 2:
        parser.error("--output: must be >= 2 (one prefill token, then decode steps)")
    if not 1 <= args.min_prompt <= args.max_prompt <= 256:
        parser.error("--min-prompt/--max-prompt: need 1 <= min <= max <= 256")
    return args


def prepare_gguf(model_dir: str, args: argparse.Namespace, out_dir: Path) -> dict[str, str]:
    """F32 by the converter, then Q8_0 and Q4_0 from it by llama.cpp; existing files are reused."""
    paths = {kind: out_dir / f"model-{kind}.gguf" for kind in ("F32", "Q8_0", "Q4_0")}
    if not paths["F32"].exists():
        if not args.converter:
            raise SystemExit(f"--converter: needed to write {paths['F32']}")
        command = [
            sys.executable,
            "-c",
            CONVERT,
            args.converter,
            model_dir,
            "--outtype",
            "f32",
            "--outfile",
            str(paths["F32"]),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            raise SystemExit(f"--converter: {args.converter} failed:\n{done.stderr[-4000:]}")
    for kind in ("Q8_0", "Q4_0"):
        if not paths[kind].exists():
            command = [
                args.llamacpp_python,
                str(WORKER),
                "quantize",
                str(paths["F32"]),
                str(paths[kind]),
                kind,
                str(args.threads),
            ]
            subprocess.run(command, check=True, timeout=900)
    return {kind: str(path) for kind, path in paths.items()}


class LlamaCpp:
    """The worker subprocess: one JSON line per request, one per answer."""

    def __init__(self, args: argparse.Namespace, gguf: dict[str, str], seqs: int) -> None:
        cells = args.max_prompt + args.output + 16
        command = [args.llamacpp_python, str(WORKER), "serve", str(args.threads), str(seqs), str(cells)]
        command += [f"{kind}={path}" for kind, path in gguf.items()]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.about = json.loads(self._line())

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"llama.cpp worker exited ({self.process.wait(timeout=30)})")
        return line

    def run(self, kind: str, prompts: list[list[int]], output: int) -> dict:
        stdin: IO[str] | None = self.process.stdin
        assert stdin is not None
        stdin.write(json.dumps({"arm": kind, "prompts": prompts, "output": output}) + "\n")
        stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        self.process.wait(timeout=60)


def run_engine(engine: LLMEngine, prompts: list[list[int]], output: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"b{index}", prompt, params)
    decode_s = decode_tokens = 0.0
    started_s = time.perf_counter()
    while engine.has_unfinished():
        step_started_s = time.perf_counter()
        engine.step()
        computed, seqs, _ = engine.last_step_shape
        if computed == seqs:  # every sequence computed one token: a pure decode step
            decode_s += time.perf_counter() - step_started_s
            decode_tokens += computed
    wall_s = time.perf_counter() - started_s
    tokens = [list(engine.pop_finished(f"b{index}").output_token_ids) for index in range(len(prompts))]
    return {
        "decode_tok_s": decode_tokens / max(decode_s, 1e-9),
        "output_tok_s": len(prompts) * output / wall_s,
        "tokens": tokens,
    }


def hf_greedy(model_dir: str, prompt: list[int], output: int) -> list[int]:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=output, min_new_tokens=output, do_sample=False)
    return ids[0, len(prompt) :].tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or str(ensure_trained_model(steps=args.trained_steps))
    batches = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="gguf-") as scratch:
        gguf = prepare_gguf(model_dir, args, Path(args.gguf_dir or scratch))
        peer = LlamaCpp(args, gguf, max(batches))
        try:
            report = _measure(args, model_dir, batches, peer)
        finally:
            peer.close()
        report["gguf_bytes"] = {kind: os.path.getsize(path) for kind, path in gguf.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _measure(args: argparse.Namespace, model_dir: str, batches: list[int], peer: LlamaCpp) -> dict:
    engines = {
        # No prefix cache: every round sends the same prompts, and llama.cpp's side starts each run empty.
        arm.name: LLMEngine(
            EngineConfig(
                model_dir=model_dir,
                max_num_seqs=max(batches),
                num_kv_blocks=1024,
                enable_prefix_caching=False,
                **arm.engine,
            )
        )
        for arm in ARMS
        if arm.engine is not None
    }

    def run(arm: Arm, prompts: list[list[int]]) -> dict:
        if arm.engine is not None:
            return run_engine(engines[arm.name], prompts, args.output)
        return peer.run(str(arm.gguf), prompts, args.output)

    for arm in ARMS:  # warm-up (kernels compiled, buffers sized), outside the timing
        run(arm, [[5, 6, 7, 8]])
    results: dict = {}
    agreement: dict = {}
    for batch in batches:
        prompts = _requests(model_dir, batch, args.min_prompt, args.max_prompt, args.seed + batch)
        runs: dict[str, list[dict]] = {arm.name: [] for arm in ARMS}
        for round_index in range(args.rounds):
            for arm in ARMS if round_index % 2 == 0 else ARMS[::-1]:
                runs[arm.name].append(run(arm, prompts))
        results[batch] = {
            name: {key: statistics.median(r[key] for r in rs) for key in ("decode_tok_s", "output_tok_s")}
            for name, rs in runs.items()
        }
        if batch == batches[0]:
            reference = hf_greedy(model_dir, prompts[0], args.output)
            agreement = {
                "prompt_tokens": len(prompts[0]),
                "hf_generate": reference,
                **{
                    name: {
                        "tokens": rs[0]["tokens"][0],
                        "prefix_equal_to_hf": common_prefix(rs[0]["tokens"][0], reference),
                    }
                    for name, rs in runs.items()
                },
            }
        _print(batch, results[batch], args)
    load = os.getloadavg()[0]
    print(f"load average (1 min) at the end: {load:.1f} on {len(os.sched_getaffinity(0))} cores")
    for name, row in agreement.items():
        if isinstance(row, dict):
            print(
                f"greedy tokens equal to HF generate (first prompt, batch {batches[0]}): {name}: "
                f"{row['prefix_equal_to_hf']} of {args.output}"
            )
    settings = {
        k: v for k, v in vars(args).items() if k not in ("json", "model", "llamacpp_python", "converter", "gguf_dir")
    }
    return {
        "machine": cpu_name(),
        "cores": len(os.sched_getaffinity(0)),
        "versions": {"torch": torch.__version__, "llama_cpp_python": peer.about["llama_cpp_python"]},
        "llama_cpp_system_info": peer.about["system_info"],
        "model": Path(model_dir).name,
        "settings": settings,
        "load_average_1min_end": load,
        "results": results,
        "greedy_agreement": agreement,
    }


def _print(batch: int, result: dict, args: argparse.Namespace) -> None:
    base = result["engine fp32"]
    print(
        f"\nbatch {batch}: {batch} requests, prompts {args.min_prompt}-{args.max_prompt}, {args.output} output "
        f"tokens each, {args.threads} threads, median of {args.rounds} rounds"
    )
    print(f"{'arm':<26}{'decode tok/s':>14}{'x eng fp32':>12}{'output tok/s':>14}{'x eng fp32':>12}")
    for name, row in result.items():
        print(
            f"{name:<26}{row['decode_tok_s']:>14.1f}{row['decode_tok_s'] / base['decode_tok_s']:>12.2f}"
            f"{row['output_tok_s']:>14.1f}{row['output_tok_s'] / base['output_tok_s']:>12.2f}"
        )


if __name__ == "__main__":
    main()
