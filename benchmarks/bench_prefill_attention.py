"""What a chunk's attention over earlier context costs on the first call at a new shape, CUDA only.

`python -m benchmarks.bench_prefill_attention [--dtypes bfloat16,float32] [--shapes 8]`

Chunked prefill, a prefix-cache hit and a draft model's catch-up all attend a chunk of new queries
over its sequence's earlier KV (engine/attention.py `attend_after_context`); every step brings a new
(query_len, context_len). A backend that builds a plan per input shape pays that on each new shape, in
the middle of a decode batch's step. Per dtype, for `--shapes` fresh shapes (the demo model's heads:
12 query heads over 4 KV heads of 64), each arm's first call and a repeat at that shape, synchronised:

- `mask`: the boolean mask the engine passed before (`allowed[i, j] = j <= context_len - query_len + i`);
- `mask-no-cudnn`: the same with cuDNN's attention backend excluded (`sdpa_kernel`);
- `engine`: `attend_after_context` as shipped (`causal_lower_right`).

Prints the median first-call and repeat milliseconds per arm, the worst first call, and the largest
difference of each arm's output from `mask`'s. Also lists the SDPA backends that accept the `mask`
call at all. `--model-lengths N`: the demo model's whole eager forward (a draft's catch-up, a prompt
with no cached prefix) over N fresh prompt lengths, first call and repeat each; the slowest first
call is profiled (torch.profiler, top ops by self time) when it is 5x the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.attention import attend_after_context

HEADS, KV_HEADS, HEAD_DIM = 12, 4, 64


def _masked(queries, keys, values, scale):
    query_len, context_len = queries.shape[2], keys.shape[2]
    offset = context_len - query_len
    allowed = (
        torch.arange(context_len, device=queries.device)[None, :]
        <= torch.arange(offset, context_len, device=queries.device)[:, None]
    )
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed, scale=scale, enable_gqa=True)


def _masked_no_cudnn(queries, keys, values, scale):
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends):
        return _masked(queries, keys, values, scale)


ARMS = {"mask": _masked, "mask-no-cudnn": _masked_no_cudnn, "engine": attend_after_context}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_ms(fn, *args) -> tuple[float, torch.Tensor]:
    _sync()
    started_s = time.perf_counter()
    out = fn(*args)
    _sync()
    return (time.perf_counter() - started_s) * 1e3, out


def _inputs(query_len: int, context_len: int, dtype: torch.dtype, generator: torch.Generator):
    def randn(heads, length):
        return torch.randn(1, heads, length, HEAD_DIM, generator=generator, device="cuda").to(dtype)

    return randn(HEADS, query_len), randn(KV_HEADS, context_len), randn(KV_HEADS, context_len), HEAD_DIM**-0.5


def _backends_accepting(dtype: torch.dtype) -> list[str]:
    args = _inputs(37, 300, dtype, torch.Generator(device="cuda").manual_seed(1))
    accepted = []
    every = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)
    for backend in every:
        try:
            with sdpa_kernel([backend]):
                _masked(*args)
            accepted.append(backend.name)
        except RuntimeError:
            pass
    return accepted


def run_dtype(dtype: torch.dtype, num_shapes: int, seed: int) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    warm = _inputs(16, 64, dtype, generator)
    for fn in ARMS.values():  # library first calls, outside every timed shape
        fn(*warm)
    rows: dict[str, dict[str, list[float]]] = {name: {"first": [], "again": [], "diff": []} for name in ARMS}
    for index in range(num_shapes):
        query_len = 5 + 37 * index + seed % 7  # fresh shapes, like a step's chunk and its context
        context_len = query_len + 131 + 53 * index
        args = _inputs(query_len, context_len, dtype, generator)
        reference = None
        for name, fn in ARMS.items():
            first_ms, out = _timed_ms(fn, *args)
            again_ms, _ = _timed_ms(fn, *args)
            reference = out if reference is None else reference
            rows[name]["first"].append(first_ms)
            rows[name]["again"].append(again_ms)
            rows[name]["diff"].append(float((out.float() - reference.float()).abs().max()))
    return {
        "backends_accepting_mask": _backends_accepting(dtype),
        **{
            name: {
                "first_call_ms_median": statistics.median(r["first"]),
                "first_call_ms_max": max(r["first"]),
                "repeat_ms_median": statistics.median(r["again"]),
                "max_abs_diff_vs_mask": max(r["diff"]),
            }
            for name, r in rows.items()
        },
    }


def run_model_lengths(dtype_name: str, count: int, device: str = "cuda") -> dict:
    """First and repeat forward of the demo model over fresh prompt lengths (no cached prefix)."""
    from types import SimpleNamespace

    from engine import LLM
    from engine.model_runner import build_step_input

    engine = LLM(None, progress=False, device=device, dtype=dtype_name, num_kv_blocks=256).engine
    engine.kv.allocate("probe", 2048)

    def step(length: int):
        chunk = SimpleNamespace(
            seq=SimpleNamespace(seq_id="probe"),
            start=0,
            num_new_tokens=length,
            input_token_ids=list(range(10, 10 + length)),
            num_logits_rows=1,
        )
        return build_step_input([chunk], engine.kv.block_table, engine.config.block_size)

    engine.runner.execute(step(64))
    firsts, repeats = [], []
    for index in range(count):
        length = 97 + 29 * index
        firsts.append(_timed_ms(engine.runner.execute, step(length))[0])
        repeats.append(_timed_ms(engine.runner.execute, step(length))[0])
    result = {"lengths": [97 + 29 * i for i in range(count)], "first_ms": firsts, "repeat_ms": repeats}
    if max(firsts) > 5 * statistics.median(firsts):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _timed_ms(engine.runner.execute, step(97 + 29 * count + 13))
        result["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--shapes", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--model-lengths", type=int, default=0, help="also time the demo model's first calls")
    args = parser.parse_args(argv)
    results: dict = {}
    for name in args.dtypes.split(",") if args.model_lengths else ():
        model = results.setdefault("model", {})[name] = run_model_lengths(name, args.model_lengths)
        print(
            name,
            "model first calls ms",
            [round(t, 1) for t in model["first_ms"]],
            "repeats",
            [round(t, 1) for t in model["repeat_ms"]],
        )
        print(model.get("profile", ""))
    for name in args.dtypes.split(","):
        results[name] = run_dtype(getattr(torch, name), args.shapes, args.seed)
        print(name, "backends accepting the mask call:", results[name]["backends_accepting_mask"])
        for arm in ARMS:
            r = results[name][arm]
            print(
                f"  {arm:14s} first call {r['first_call_ms_median']:8.2f} ms (max {r['first_call_ms_max']:8.2f})  "
                f"repeat {r['repeat_ms_median']:6.2f} ms  max |diff| vs mask {r['max_abs_diff_vs_mask']:.2e}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
