"""The engine on one GPU against the device's own ceilings, measured in the same run.

- ceilings: HBM bandwidth from a device-to-device copy (bytes read + written / time) and bf16 matmul
  rate from an 8192^3 product on random data;
- decode step time (graphs and eager) vs the HBM roofline = (weight bytes + KV bytes read per step) /
  measured bandwidth, for a 1B-class Llama (Llama-3.2-1B shape, random weights) at batch 1, 16, 64;
- decode attention alone: the Triton kernel vs the PyTorch gather path, as KV GB/s;
- prefill tokens/s and model FLOP/s vs the measured bf16 rate.

Needs CUDA. `python -m benchmarks.bench_gpu_decode --out results.json`
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import StepInput, attention_metadata

LLAMA_1B: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
}


def timed_ms(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time of `fn` in ms, synchronizing around each call (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def ceilings() -> dict:
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = timed_ms(lambda: dst.copy_(src))
    bandwidth = 2 * src.numel() * 4 / (copy_ms / 1e3)
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm_ms = timed_ms(lambda: a @ b, repeats=10)
    return {"hbm_bytes_per_s": bandwidth, "bf16_flops_per_s": 2 * 8192**3 / (mm_ms / 1e3)}


def build_checkpoint(directory: Path, dtype: torch.dtype = torch.bfloat16, max_position: int | None = None) -> Path:
    """A random-weight 1B Llama in HF format, built on the GPU (std 0.02, HF's init), saved once.
    `max_position`: the context it takes (default 8192; Llama-3.2-1B's own is 131072, which a profile
    for planning long traces needs: rows longer than the model are dropped from a plan)."""
    torch.manual_seed(0)
    shape = {**LLAMA_1B, **({"max_position_embeddings": max_position} if max_position else {})}
    with torch.device("cuda"):
        # transformers wraps PreTrainedModel.to in a decorator whose signature mypy misreads.
        model = LlamaForCausalLM(LlamaConfig(**shape, dtype="bfloat16")).to(dtype)  # type: ignore[arg-type]
    model.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()
    return directory


def decode_step(batch: int, context: int, block_size: int, first_block: int = 0) -> StepInput:
    """A decode step for `batch` sequences holding `context` tokens each (the last one is new)."""
    per_seq = -(-context // block_size)
    tables = torch.arange(first_block, first_block + batch * per_seq).view(batch, per_seq)
    last = context - 1
    return StepInput(
        input_ids=torch.randint(1000, 100000, (batch,)),
        positions=torch.full((batch,), last),
        slot_mapping=tables[:, last // block_size] * block_size + last % block_size,
        num_decode_tokens=batch,
        decode_context_lens=torch.full((batch,), context),
        decode_block_tables=tables,
        prefill_query_lens=(),
        prefill_context_lens=(),
        prefill_block_tables=(),
        logits_indices=torch.arange(batch),
    )


def prefill_step(num_seqs: int, length: int, block_size: int, cached: int = 0) -> StepInput:
    """A step of `num_seqs` prompt chunks of `length` new tokens each, after `cached` tokens already in
    the cache (disjoint blocks; what the cached slots hold does not change the time)."""
    total = cached + length
    per_seq = -(-total // block_size)
    tables = [torch.arange(i * per_seq, (i + 1) * per_seq) for i in range(num_seqs)]
    positions = torch.arange(cached, total)
    slots = torch.cat([t[positions // block_size] * block_size + positions % block_size for t in tables])
    return StepInput(
        input_ids=torch.randint(1000, 100000, (num_seqs * length,)),
        positions=positions.repeat(num_seqs),
        slot_mapping=slots,
        num_decode_tokens=0,
        decode_context_lens=torch.zeros(0, dtype=torch.int64),
        decode_block_tables=torch.zeros(0, 0, dtype=torch.int64),
        prefill_query_lens=(length,) * num_seqs,
        prefill_context_lens=(total,) * num_seqs,
        prefill_block_tables=tuple(tables),
        logits_indices=torch.arange(length - 1, num_seqs * length, length),
    )


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights: every parameter once (a tied LM head reads the
    embedding table once; the embedding lookup itself reads only a row per sequence)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_figures(engine: LLMEngine, batches, context: int, bandwidth: float) -> list[dict]:
    runner = engine.runner
    kv = runner.kv_cache
    kv.values.normal_()  # never time on zeros
    weights = weight_bytes(runner.model)
    rows = []
    for batch in batches:
        step = decode_step(batch, context, runner.block_size)
        kv_read = batch * context * kv.bytes_per_token
        roofline_ms = (weights + kv_read) / bandwidth * 1e3
        graphs = runner.graphs
        graph_ms = timed_ms(lambda step=step: runner.execute(step), repeats=50)
        runner.graphs = None
        eager_ms = timed_ms(lambda step=step: runner.execute(step), repeats=20)
        runner.graphs = graphs
        rows.append(
            {
                "batch": batch,
                "context": context,
                "weight_bytes": weights,
                "kv_bytes": kv_read,
                "roofline_ms": roofline_ms,
                "graph_ms": graph_ms,
                "eager_ms": eager_ms,
                "graph_over_roofline": graph_ms / roofline_ms,
                "eager_over_roofline": eager_ms / roofline_ms,
            }
        )
        print(
            f"decode batch {batch:3d} ctx {context}: graphs {graph_ms:.3f} ms, eager {eager_ms:.3f} ms, "
            f"roofline {roofline_ms:.3f} ms -> {graph_ms / roofline_ms:.2f}x",
            flush=True,
        )
    return rows


def attention_figures(engine: LLMEngine, batch: int, context: int, bandwidth: float) -> list[dict]:
    """One layer's decode attention alone (no cache write): the Triton kernel vs the PyTorch gather
    path, timed as a CUDA graph of 20 calls (as the engine runs it: no Python launch cost)."""
    from engine.attention import _decode_attention
    from engine.kernels.triton_decode import paged_decode_attention

    runner = engine.runner
    layer = runner.kv_cache.layer(0)
    step = decode_step(batch, context, runner.block_size).to(runner.device)
    q = torch.randn(batch, runner.model.config.num_heads, layer.k.shape[-1], device="cuda", dtype=layer.k.dtype)
    kv_bytes = batch * context * 2 * layer.k.shape[0] * layer.k.shape[-1] * layer.k.element_size()
    padded = attention_metadata(step, runner.block_size, native_decode=False)
    kernels = {
        "triton": lambda: paged_decode_attention(
            q, layer.k, layer.v, None, None, step.decode_block_tables, step.decode_context_lens, 0.125
        ),
        "torch-gather": lambda: _decode_attention(q, layer.k, layer.v, padded, 0.125),
    }
    rows = []
    for name, kernel in kernels.items():
        kernel()  # compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # 20 calls replayed at once: the kernels' time, not Python's
            for _ in range(20):
                kernel()
        ms = timed_ms(graph.replay, repeats=10) / 20
        rows.append(
            {
                "kernel": name,
                "batch": batch,
                "context": context,
                "ms": ms,
                "kv_bytes_per_s": kv_bytes / (ms / 1e3),
                "fraction_of_hbm": kv_bytes / (ms / 1e3) / bandwidth,
            }
        )
        print(
            f"attention {name}: {ms * 1e3:.1f} us, {kv_bytes / (ms / 1e3) / 1e9:.0f} GB/s "
            f"({kv_bytes / (ms / 1e3) / bandwidth:.0%} of HBM)",
            flush=True,
        )
    return rows


def kernel_breakdown(engine: LLMEngine, batch: int, context: int) -> dict:
    """GPU time of one eager decode step by kernel (profiler): where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.runner
    step = decode_step(batch, context, runner.block_size)
    graphs, runner.graphs = runner.graphs, None
    runner.execute(step)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.execute(step)
        torch.cuda.synchronize()
    runner.graphs = graphs
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_us = sum(e.self_device_time_total for e in events)
    count = sum(e.count for e in events)
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:8]
    print(f"kernels of one batch-{batch} step: {count} launches, {total_us / 1e3:.3f} ms of GPU time", flush=True)
    for e in top:
        print(f"  {e.self_device_time_total:9.1f} us x{e.count:4d}  {e.key[:90]}", flush=True)
    return {
        "batch": batch,
        "launches": count,
        "gpu_ms": total_us / 1e3,
        "top": [{"name": e.key[:120], "us": e.self_device_time_total, "count": e.count} for e in top],
    }


def prefill_figures(engine: LLMEngine, num_seqs: int, length: int, peak: float) -> dict:
    runner = engine.runner
    cfg = runner.model.config
    step = prefill_step(num_seqs, length, runner.block_size)
    ms = timed_ms(lambda: runner.execute(step), repeats=5, warmup=2)
    tokens = num_seqs * length
    linear = 2 * tokens * sum(p.numel() for n, p in runner.model.named_parameters() if n.endswith("proj.weight"))
    attention = 2 * num_seqs * length * length * cfg.num_heads * cfg.head_dim * cfg.num_layers  # causal half of 4
    head = 2 * num_seqs * cfg.hidden_size * cfg.vocab_size
    flops = linear + attention + head
    print(
        f"prefill {num_seqs}x{length}: {ms:.1f} ms, {tokens / (ms / 1e3):.0f} tok/s, "
        f"{flops / (ms / 1e3) / 1e12:.0f} TFLOP/s = {flops / (ms / 1e3) / peak:.0%} of bf16 peak",
        flush=True,
    )
    return {
        "num_seqs": num_seqs,
        "length": length,
        "ms": ms,
        "tokens_per_s": tokens / (ms / 1e3),
        "flops_per_s": flops / (ms / 1e3),
        "fraction_of_peak": flops / (ms / 1e3) / peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_decode.json")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--checkpoint", default="", help="an existing 1B checkpoint dir (default: build one)")
    args = parser.parse_args()
    started = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **ceilings()}
    print(
        f"ceilings: {result['hbm_bytes_per_s'] / 1e12:.2f} TB/s copy, "
        f"{result['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s bf16",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.checkpoint) if args.checkpoint else build_checkpoint(Path(tmp) / "llama-1b")
        batches = [int(b) for b in args.batches.split(",")]
        blocks = max(batches) * -(-args.context // 16) + 8 * 2048 // 16 + 64
        engine = LLMEngine(
            EngineConfig(
                model_dir=str(model_dir),
                device="cuda",
                max_num_seqs=max(batches),
                max_model_len=max(2048, args.context),
                num_kv_blocks=blocks,
                max_num_batched_tokens=16384,
                prefill_chunk_tokens=2048,
            )
        )
        result["decode"] = decode_figures(engine, batches, args.context, result["hbm_bytes_per_s"])
        result["attention"] = attention_figures(engine, max(batches), args.context, result["hbm_bytes_per_s"])
        result["breakdown"] = [kernel_breakdown(engine, b, args.context) for b in (1, max(batches))]
        result["prefill"] = prefill_figures(engine, 8, 2048, result["bf16_flops_per_s"])
    result["elapsed_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
