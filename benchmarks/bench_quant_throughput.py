"""Engine throughput with quantization vs fp32, same requests, same run.

`python -m benchmarks.bench_quant_throughput [--model DIR] [--batch-sizes 1,8,32] [--threads N]`.
For each batch size B (max_num_seqs), B requests (prompt lengths uniform in [--min-prompt,
--max-prompt], `--output` tokens each, EOS ignored, greedy) run through one `LLMEngine` per
configuration: fp32, int8 weights, int8 weights and LM head, int8 KV, fp8 KV, int8 weights + int8 KV,
group-wise int4 weights (`--configs`). Engine steps are timed one by one: decode tok/s = tokens of steps
that only decode / their time; output tok/s = all output tokens / wall time (prefill included). Configurations alternate
order per round (`--rounds`) and the median is kept, so drift on a shared machine hits every
configuration alike.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch

from benchmarks.bench_quant_perplexity import cpu_name
from engine.config import EngineConfig
from engine.demo_model import ensure_demo_model
from engine.llm_engine import LLMEngine
from engine.model_loader import load_model_config
from engine.sampling_params import SamplingParams

CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "int8-weights": {"quantization": "int8"},
    "int8-weights+lm-head": {"quantization": "int8", "quantize_lm_head": True},
    "int8-weights-g128": {"quantization": "int8", "quantization_group_size": 128},
    "int8-kv": {"kv_cache_dtype": "int8"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "int8-weights+int8-kv": {"quantization": "int8", "kv_cache_dtype": "int8"},
    "int4-weights": {"quantization": "int4"},  # groups of 128
}


def _requests(model_dir: str, count: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    model = load_model_config(model_dir)
    vocab = [t for t in range(model.vocab_size) if t not in {*model.eos_token_ids, model.bos_token_id}]
    rng = random.Random(seed)
    return [rng.choices(vocab, k=rng.randint(lo, hi)) for _ in range(count)]


def _run(engine: LLMEngine, prompts: list[list[int]], output: int) -> dict:
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
    for index in range(len(prompts)):
        engine.pop_finished(f"b{index}")
    return {"output_tok_s": len(prompts) * output / wall_s, "decode_tok_s": decode_tokens / max(decode_s, 1e-9)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or str(ensure_demo_model())
    names = args.configs.split(",")
    max_num_seqs = max(map(int, args.batch_sizes.split(",")))
    engines = {
        name: LLMEngine(
            EngineConfig(model_dir=model_dir, max_num_seqs=max_num_seqs, num_kv_blocks=4096, **CONFIGS[name])
        )
        for name in names
    }
    for engine in engines.values():
        _run(engine, [[5, 6, 7, 8]], 2)  # warm-up (kernels compiled, buffers sized), outside the timing
    results: dict = {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = _requests(model_dir, batch, args.min_prompt, args.max_prompt, args.seed + batch)
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for round_index in range(args.rounds):
            order = names if round_index % 2 == 0 else names[::-1]
            for name in order:
                runs[name].append(_run(engines[name], prompts, args.output))
        results[batch] = {
            name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()
        }
        _print(batch, results[batch], args)
    load = os.getloadavg()[0]
    print(f"load average (1 min) at the end: {load:.1f} on {len(os.sched_getaffinity(0))} cores")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "model")}
        with open(args.json, "w") as handle:
            report = {"machine": cpu_name(), "settings": settings, "load_average_1min_end": load, "results": results}
            json.dump(report, handle, indent=2)
            handle.write("\n")
    return results


def _print(batch: int, result: dict, args) -> None:
    base = result.get("fp32")
    print(
        f"\nbatch {batch}: {batch} requests, prompts {args.min_prompt}-{args.max_prompt}, {args.output} output "
        f"tokens each, {args.threads} threads, median of {args.rounds} rounds"
    )
    print(f"{'config':<24}{'decode tok/s':>14}{'x fp32':>8}{'output tok/s':>14}{'x fp32':>8}")
    for name, row in result.items():
        ratio = (lambda key, row=row: row[key] / base[key]) if base else (lambda key: float("nan"))
        print(
            f"{name:<24}{row['decode_tok_s']:>14.1f}{ratio('decode_tok_s'):>8.2f}{row['output_tok_s']:>14.1f}"
            f"{ratio('output_tok_s'):>8.2f}"
        )


if __name__ == "__main__":
    main()
