"""Draft-model speculation as a function of how often the draft agrees with the target, same run.

`python -m benchmarks.bench_spec_agreement [--scales 1,0.2,0.1] [--batches 1,8,64]`

Why: a layer-truncated copy of a *random-weight* target predicts almost nothing of what the full stack
computes (bench_spec: acceptance 0.02-0.21), so that benchmark cannot show what a draft that agrees
buys. Trained models differ: their upper layers refine the residual stream more than they rewrite it,
which is what early-exit and self-speculative drafts (LayerSkip, Draft & Verify) rely on. This script
makes that property a dial. For each `scale`, the target is the demo checkpoint with the residual
writes of every layer above the draft's (`o_proj` and `down_proj` of layers >= `--draft-layers`)
multiplied by `scale`, and the draft is that target's first `--draft-layers` layers with its
embeddings, norm and head (bench_spec's truncated copy). scale 1 is the plain demo model; smaller
scales give drafts that agree more often, on a model whose shapes, and so costs, are unchanged.

Per scale, three colocated engines on the same prompts (bench_spec's "output repeats the prompt"
workload): plain (the baseline), `draft` (adaptive switch on, as shipped) and `draft-forced` (switch
off). Each batch size: `--warmup-rounds` untimed rounds, then `--repeats` timed rounds round-robin,
medians (bench_spec.measure_batch). x = plain TPOT / arm TPOT, measured against the plain engine of the
same scale in the same run; acceptance = drafts accepted / proposed; `exact`: tokens equal plain's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.bench_spec import (
    add_common_arguments,
    add_ratios,
    measure,
    measure_batch,
    repeat_workload,
    serving_heap,
    truncated_copy,
)
from engine import LLM
from engine.demo_model import ensure_demo_model

RESIDUAL_WRITES = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def damped_target(model_dir: Path, keep_layers: int, scale: float, out_dir: Path) -> Path:
    """A copy of `model_dir` whose layers >= `keep_layers` write `scale` times as much into the residual
    stream (their attention output and MLP down projections scaled); everything else is unchanged."""
    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            parts = name.split(".")
            damped = "layers" in parts and int(parts[parts.index("layers") + 1]) >= keep_layers
            tensors[name] = tensor * scale if damped and name.endswith(RESIDUAL_WRITES) else tensor
    save_file(tensors, out_dir / "model.safetensors")
    return out_dir


def run_scale(model_dir: Path, scale: float, args, work_dir: Path) -> dict:
    target_dir = damped_target(model_dir, args.draft_layers, scale, work_dir / f"target-{scale}")
    draft_dir = truncated_copy(target_dir, args.draft_layers, work_dir / f"draft-{scale}")
    common = {"progress": False, "num_kv_blocks": args.num_kv_blocks, "max_num_seqs": max(args.batches)}
    common.update(device=args.device, dtype=args.dtype)
    draft = {"model": str(draft_dir), "num_speculative_tokens": args.k}
    arms = {
        "plain": LLM(target_dir, **common),
        "draft": LLM(target_dir, **common, speculative_config=draft),
        "draft-forced": LLM(target_dir, **common, speculative_config={**draft, "adaptive": False}),
    }
    prompts = repeat_workload(arms["plain"], max(args.batches), args.text_tokens, args.seed)
    for llm in arms.values():  # first-call costs, outside every round
        measure(llm, prompts[:1], 8)
    batches = {}
    with serving_heap(not args.no_freeze_heap):
        for batch in args.batches:
            rows = add_ratios(measure_batch(arms, prompts[:batch], args.max_tokens, args.repeats, args.warmup_rounds))
            batches[batch] = rows
            _print(scale, batch, rows)
    return batches


def _print(scale: float, batch: int, rows: dict) -> None:
    for name, r in rows.items():
        print(
            f"scale {scale:<5g} batch {batch:<3d} {name:13s} TPOT {r['tpot_ms']:8.2f} ms  x {r['tpot_ratio']:5.2f} "
            f"(paired {r['tpot_ratio_paired']:5.2f})  "
            f"tok/s x {r['throughput_ratio']:5.2f}  accept {r.get('acceptance', float('nan')):5.2f}  "
            f"spec steps {r.get('spec_step_share', float('nan')):5.2f}  exact {r['exact']}  "
            f"stall ms {max(r['stall_ms_runs']):6.1f} {r['stalls_runs']}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, output_tokens=32)
    parser.add_argument("--scales", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 0.2, 0.1])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else ensure_demo_model()
    work_dir = Path(tempfile.mkdtemp(prefix="spec-agreement-"))
    try:
        results = {"k": args.k, "draft_layers": args.draft_layers, "repeats": args.repeats, "scales": {}}
        for scale in args.scales:
            results["scales"][scale] = run_scale(model_dir, scale, args, work_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
