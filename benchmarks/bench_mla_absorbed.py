"""Absorbed vs expanded MLA decode attention, per layer, on CPU.

`python -m benchmarks.bench_mla_absorbed [--batches 1 16] [--contexts 512 2048] [--json PATH]` (inside
scripts/in_sandbox.sh). One engine/models/mla.py `MLAttention` layer with random weights, fp32, one
thread: a decode step's attention for `batch` rows over `context` latents each (the latents read from
the cache, the query after its projection and RoPE), through `_expanded_attention` (every context
latent expanded by kv_b into per-head keys and values, as HF computes it) and `_absorbed_attention`
(kv_b folded into the query and the output; attention over the latents). Shapes:
- `tiny`: the test checkpoints' (4 heads, kv_lora_rank 16, rope 8, nope 16, v 16);
- `v2-lite`: DeepSeek-V2-Lite's attention (16 heads, kv_lora_rank 512, rope 64, nope 128, v 128).
Reported: the median time of one layer's decode attention over `--steps` steps (after 3 warm-up steps)
for each arm and their ratio, measured in the same run, arms interleaved step by step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.config import MLAConfig, ModelConfig, RopeConfig
from engine.models.mla import MLAttention
from engine.parallel import SINGLE_RANK

# shape → (hidden, heads, MLA config)
SHAPES = {
    "tiny": (64, 4, MLAConfig(16, None, 16, 8, 16, True)),
    "v2-lite": (2048, 16, MLAConfig(512, None, 128, 64, 128, True)),
}


def _layer(shape: str) -> MLAttention:
    hidden, heads, mla = SHAPES[shape]
    cfg = ModelConfig(
        "DeepseekV2ForCausalLM", 512, hidden, 4 * hidden, 1, heads, 1, mla.latent_dim, 1e-6, 8192,
        RopeConfig(), False, False, False, "float32", mla=mla,
    )  # fmt: skip
    layer = MLAttention(cfg, SINGLE_RANK, "none")
    gen = torch.Generator().manual_seed(0)
    for param in layer.parameters():
        param.data.normal_(0.0, 0.02, generator=gen)
    return layer


@torch.inference_mode()
def _measure(shape: str, batch: int, context: int, steps: int) -> dict:
    layer = _layer(shape)
    mla = layer.mla
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    queries = torch.randn(batch, layer.num_heads, mla.qk_head_dim, generator=gen)
    latents = torch.randn(batch, context, mla.latent_dim, generator=gen)
    padding = torch.zeros(batch, context, dtype=torch.bool)
    arms = {"expanded": layer._expanded_attention, "absorbed": layer._absorbed_attention}
    times_s: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(steps + 3):  # three warm-up steps; the arms alternate so load drifts hit both
        for arm, attend in arms.items():
            started_s = time.perf_counter()
            attend(queries, latents, padding)
            times_s[arm].append(time.perf_counter() - started_s)
    medians_ms = {arm: statistics.median(t[3:]) * 1e3 for arm, t in times_s.items()}
    return {
        "shape": shape,
        "batch": batch,
        "context": context,
        **{f"{arm}_ms": ms for arm, ms in medians_ms.items()},
        "speedup": medians_ms["expanded"] / medians_ms["absorbed"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for shape in args.shapes:
        for batch in args.batches:
            for context in args.contexts:
                row = _measure(shape, batch, context, args.steps)
                rows.append(row)
                print(
                    f"{shape:>8} batch {batch:>3} context {context:>5}: expanded {row['expanded_ms']:9.3f} ms"
                    f"  absorbed {row['absorbed_ms']:9.3f} ms  {row['speedup']:6.2f}x"
                )
    result = {"threads": 1, "dtype": "float32", "steps": args.steps, "rows": rows}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
