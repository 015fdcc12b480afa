"""Perplexity of the trained small model (benchmarks/trained_model.py) on held-out text, unquantized
and under every weight quantization the engine serves, same run.

`python -m benchmarks.bench_quant_perplexity [--json PATH] [--window-tokens N] [--windows N] [--steps N]`

Held-out text: `docs/architecture.md` (the model was trained on `engine/data/demo_corpus.txt` only; the
architecture page is prose about the same subject that it never saw). It is cut into windows of
`--window-tokens`; each is scored by the engine through prompt logprobs (every token after the first
of a window), and perplexity is exp(mean negative log-likelihood) over all scored tokens.

Configurations: fp32; int8 at load (per output channel); and checkpoints written by `splitserve
quantize` (calibrated on the training corpus, 32 windows of 128 tokens): int8 group-wise (RTN, g128),
int4 RTN / AWQ / GPTQ (g128; GPTQ also with act-order). The embedding and the tied LM head stay fp32 in
every configuration, as quantized releases leave them.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from benchmarks.trained_model import ensure_trained_model
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from splitserve.quantize import main as quantize_main

HELD_OUT = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
# name → (`splitserve quantize` flags or None for the checkpoint itself, engine arguments)
CONFIGS: dict[str, tuple[list[str] | None, dict]] = {
    "fp32": (None, {}),
    "int8 per channel (at load)": (None, {"quantization": "int8"}),
    "int8 g128 RTN": (["--method", "rtn", "--bits", "8", "--group-size", "128"], {}),
    "int4 g128 RTN": (["--method", "rtn", "--bits", "4", "--group-size", "128"], {}),
    "int4 g128 AWQ": (["--method", "awq", "--bits", "4", "--group-size", "128"], {}),
    "int4 g128 GPTQ": (["--method", "gptq", "--bits", "4", "--group-size", "128"], {}),
    "int4 g128 GPTQ act-order": (["--method", "gptq", "--bits", "4", "--group-size", "128", "--act-order"], {}),
}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def held_out_windows(model_dir: Path, window_tokens: int, windows: int) -> list[list[int]]:
    ids = AutoTokenizer.from_pretrained(model_dir)(HELD_OUT.read_text(encoding="utf-8"), verbose=False)["input_ids"]
    count = min(windows, len(ids) // window_tokens)
    return [ids[i * window_tokens : (i + 1) * window_tokens] for i in range(count)]


def perplexity(model_dir: Path, prompts: list[list[int]], engine_args: dict) -> float:
    llm = LLM(str(model_dir), progress=False, dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    nll = [-entry.sampled_logprob for out in outputs for entry in (out.prompt_logprobs or ())[1:]]
    return math.exp(sum(nll) / len(nll))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--window-tokens", type=int, default=256)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300, help="training steps of the trained model")
    args = parser.parse_args(argv)
    model_dir = ensure_trained_model(steps=args.steps)
    prompts = held_out_windows(model_dir, args.window_tokens, args.windows)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (flags, engine_args) in CONFIGS.items():
            started_s = time.monotonic()
            served = model_dir
            if flags is not None:
                served = Path(tmp) / name.replace(" ", "-")
                quantize_main([str(model_dir), str(served), *flags])
            quantize_s = time.monotonic() - started_s
            ppl = perplexity(served, prompts, engine_args)
            rows.append({"config": name, "perplexity": round(ppl, 4), "quantize_s": round(quantize_s, 1)})
            print(f"{name:<28} perplexity {ppl:8.4f}   (quantize {quantize_s:5.1f} s)", flush=True)
    report = {
        "benchmark": "quant_perplexity",
        "machine": cpu_name(),
        "model": str(model_dir.name),
        "held_out": "docs/architecture.md",
        "scored_tokens": sum(len(p) - 1 for p in prompts),
        "args": {"window_tokens": args.window_tokens, "windows": len(prompts), "steps": args.steps},
        "rows": rows,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
