"""int4 experts vs dequantized experts: decode tok/s and expert-weight bytes of one GPTQ MoE checkpoint.

`python -m benchmarks.bench_int4_experts [--out DIR] [--batch-sizes 1,8] [--rounds 3] [--json PATH]`.
Builds a random Qwen3-MoE checkpoint with transformers' own classes (hidden 512, 4 layers, 16 experts of
256 features, top-2: 25 M expert weights, 89% of the decoder layers' weights) and writes it in GPTQ's
layout with `splitserve quantize --method rtn --bits 4 --group-size 128`, then serves it twice in fp32:
`quantization: none` (every GPTQ layer, experts included, dequantized at load) and `quantization: int4`
(the checkpoint's own 4-bit integers: engine/layers/fused_moe.py `Int4Experts`). For each batch size B,
B requests (prompts of 16-48 tokens, `--output` tokens each, greedy, EOS ignored) run through each
engine; decode tok/s = tokens of steps that only decode / their time. The two arms alternate order each
round; the figure is the median over `--rounds` of each round's int4 / dequantized ratio (the two arms
of a round run back to back, so drift on a shared machine cancels in it). Expert bytes: every parameter
and buffer of the fused expert layers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from benchmarks.bench_quant_perplexity import cpu_name
from engine.config import EngineConfig
from engine.demo_model import SPECIAL_TOKEN_IDS, ensure_demo_model
from engine.layers.fused_moe import FusedMoE
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from splitserve.cli import main as cli_main

SHAPE = {"hidden_size": 512, "num_hidden_layers": 4, "num_experts": 16, "moe_intermediate_size": 256, "top_k": 2}
VOCAB_SIZE = 4480  # the demo model's (padded) vocabulary, whose tokenizer the checkpoint ships
ARMS = {"dequantized experts": "none", "int4 experts": "int4"}


def build_checkpoint(out_dir: Path) -> Path:
    """A random Qwen3-MoE checkpoint (std 0.02, router std 1 so routing is not uniform), quantized."""
    source, quantized = out_dir / "fp32", out_dir / "gptq-w4-g128"
    if (quantized / "config.json").exists():
        return quantized
    tokenizer_dir = ensure_demo_model()  # its tokenizer; the model's vocabulary is the demo model's
    options: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": SHAPE["hidden_size"],
        "intermediate_size": 1024,
        "moe_intermediate_size": SHAPE["moe_intermediate_size"],
        "num_hidden_layers": SHAPE["num_hidden_layers"],
        "num_attention_heads": 8,  # heads of 64
        "num_key_value_heads": 4,
        "num_experts": SHAPE["num_experts"],
        "num_experts_per_tok": SHAPE["top_k"],
        "norm_topk_prob": True,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "dtype": "float32",
        **SPECIAL_TOKEN_IDS,
    }
    config = Qwen3MoeConfig(**options)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 1.0 if name.endswith("mlp.gate.weight") else 0.02)
    model.save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (source / name).write_bytes((tokenizer_dir / name).read_bytes())
    cli_main(["quantize", str(source), str(quantized), "--method", "rtn", "--bits", "4", "--group-size", "128"])
    return quantized


def expert_bytes(engine: LLMEngine) -> int:
    layers = [m for m in engine.runner.model.modules() if isinstance(m, FusedMoE)]
    return sum(t.numel() * t.element_size() for layer in layers for t in (*layer.parameters(), *layer.buffers()))


def _run(engine: LLMEngine, prompts: list[list[int]], output: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"b{index}", prompt, params)
    decode_s = decode_tokens = 0.0
    while engine.has_unfinished():
        started_s = time.perf_counter()
        engine.step()
        computed, seqs, _ = engine.last_step_shape
        if computed == seqs:  # every sequence computed one token: a pure decode step
            decode_s += time.perf_counter() - started_s
            decode_tokens += computed
    tokens = [list(engine.pop_finished(f"b{index}").output_token_ids) for index in range(len(prompts))]
    return decode_tokens / max(decode_s, 1e-9), tokens


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-int4-experts"), help="where the checkpoints go")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = build_checkpoint(args.out)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engines = {
        arm: LLMEngine(
            EngineConfig(
                model_dir=str(model_dir),
                dtype="float32",
                max_num_seqs=max(batches),
                num_kv_blocks=1024,
                num_threads=args.threads,
                quantization=quantization,
            )
        )
        for arm, quantization in ARMS.items()
    }
    bytes_by_arm = {arm: expert_bytes(engine) for arm, engine in engines.items()}
    for engine in engines.values():
        _run(engine, [[5, 6, 7, 8]], 2)  # warm-up, outside the timing
    results: dict = {}
    rng = random.Random(0)
    for batch in batches:
        prompts = [[rng.randrange(8, VOCAB_SIZE) for _ in range(rng.randint(16, 48))] for _ in range(batch)]
        runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
        tokens: dict[str, list[list[int]]] = {}
        for round_index in range(args.rounds):
            for arm in list(ARMS) if round_index % 2 == 0 else list(ARMS)[::-1]:
                tok_s, tokens[arm] = _run(engines[arm], prompts, args.output)
                runs[arm].append(tok_s)
        medians = {arm: statistics.median(values) for arm, values in runs.items()}
        # Each round's two arms ran back to back: their ratio cancels the machine's drift between rounds.
        paired = [q / d for q, d in zip(runs["int4 experts"], runs["dequantized experts"], strict=True)]
        results[batch] = {
            "decode_tok_s": medians,
            "decode_tok_s_runs": runs,
            "int4_over_dequantized_per_round": paired,
            "int4_over_dequantized": statistics.median(paired),
            "same_tokens": tokens["int4 experts"] == tokens["dequantized experts"],
        }
        print(
            f"batch {batch}: decode tok/s dequantized {medians['dequantized experts']:.1f}, int4 "
            f"{medians['int4 experts']:.1f} (x{results[batch]['int4_over_dequantized']:.2f}), same tokens: "
            f"{results[batch]['same_tokens']}"
        )
    ratio = bytes_by_arm["int4 experts"] / bytes_by_arm["dequantized experts"]
    print(
        f"expert bytes: dequantized {bytes_by_arm['dequantized experts']:,}, int4 {bytes_by_arm['int4 experts']:,} "
        f"(x{ratio:.3f})"
    )
    load = os.getloadavg()[0]
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "machine": cpu_name(),
            "model": {
                **SHAPE,
                "checkpoint": "GPTQ v1, 4-bit, groups of 128, symmetric (splitserve quantize --method rtn)",
            },
            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "out")},
            "expert_bytes": bytes_by_arm,
            "expert_bytes_int4_over_dequantized": ratio,
            "load_average_1min_end": load,
            "results": results,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
