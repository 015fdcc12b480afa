"""Speculative decoding vs plain decoding: TPOT and output tokens/s at several batch sizes, same run.

`python -m benchmarks.bench_spec [--model DIR] [--batches 1,8,64] [--max-tokens 48] [--k 4]`
(default model: the demo checkpoint). Arms, each its own colocated engine, all on the same prompts:

- plain: no speculation (the baseline every ratio is against);
- ngram: prompt lookup, adaptive off-switch on (the shipped default), and `ngram-forced` (adaptive off:
  speculates on every step, to show what the switch saves);
- draft: a layer-truncated copy of the target (its first `--draft-layers` layers, same embeddings, norm
  and head), adaptive on, and `draft-forced`;
- with `--int8-self-draft`, `int8-self` (and `-forced`): the target's own checkpoint as the draft, its
  weights quantized to int8 at load (`speculative_config.quantization`): a draft that agrees often,
  where a truncated copy of a random-weight model rarely does.

Workload, "the output repeats the prompt" (code edit / summary shaped): each prompt is a random text
X, the model's own greedy continuation G of X (computed here without speculation), and X again, so the
continuation after the second X tends to repeat G, which prompt lookup can find.

TPOT: each request's mean time per output token after the first (RequestMetrics.tpot_s), averaged over
the batch; tokens/s: output tokens of the batch / wall time of its `generate`. Each arm runs
`--repeats` times per batch, round-robin with the others (each round starting one arm later), after
`--warmup-rounds` untimed rounds (the switch learning the batch size, first calls at its shapes; the
first round's TPOT is reported apart), and every figure is the median; `paired` is the median of the
per-round ratios to plain. `--control` adds a second plain engine: its ratio is the run's noise floor.
Acceptance: drafts accepted / proposed during that arm. `--handoff-prompt N` also times the draft's
catch-up over an N-token prompt (what a decode instance computes after a hand-off) against the
target's prefill of it.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import torch
from safetensors.torch import load_file, save_file

from benchmarks.step_timer import StepTimer
from engine import LLM, SamplingParams
from engine.heap import CollectionPauses, freeze_startup_heap
from engine.model_runner import build_step_input
from engine.sequence import Sequence
from engine.speculative.draft_model import DraftChunk


def truncated_copy(model_dir: Path, num_layers: int, out_dir: Path) -> Path:
    """The target's first `num_layers` decoder layers with its embeddings, final norm and LM head."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            tensors[name] = tensor
    save_file(tensors, out_dir / "model.safetensors")
    for extra in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (model_dir / extra).exists():
            shutil.copy(model_dir / extra, out_dir / extra)
    return out_dir


def repeat_workload(llm: LLM, count: int, text_tokens: int, seed: int) -> list[list[int]]:
    vocab = llm.engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    texts = [torch.randint(10, vocab, (text_tokens,), generator=generator).tolist() for _ in range(count)]
    params = SamplingParams(temperature=0.0, max_tokens=text_tokens, ignore_eos=True)
    continuations = [list(o.token_ids) for o in llm.generate(texts, params, use_tqdm=False)]
    return [x + g + x for x, g in zip(texts, continuations, strict=True)]


def measure(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    spec = llm.engine.spec
    before = spec.counters if spec is not None else None
    with CollectionPauses() as pauses, StepTimer(llm.engine) as steps:
        started_s = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - started_s
    row = {
        "tpot_ms": statistics.mean(o.metrics.tpot_s for o in outs) * 1e3,
        "tokens_per_s": sum(len(o.token_ids) for o in outs) / wall_s,
        "gc_full_pause_ms": pauses.total_s * 1e3,  # full collections during the round
        "stall_ms": steps.stall_seconds() * 1e3,  # steps far above the round's median, beyond it
        "stalls": [(round(s.duration_s * 1e3, 2), *s.shape, s.draft_caught_up) for s in steps.stalls()[:3]],
    }
    if spec is not None:
        row["pattern"] = steps.pattern()
    if spec is not None and before is not None:
        after = spec.counters
        drafts, accepted = after.draft_tokens - before.draft_tokens, after.accepted_tokens - before.accepted_tokens
        on, off = after.steps_on - before.steps_on, after.steps_off - before.steps_off
        row.update(acceptance=accepted / drafts if drafts else 0.0, spec_step_share=on / max(on + off, 1))
        # What the switch measured for this batch size: (speculative, plain) microseconds per token.
        row.update(zip(("switch_spec_us", "switch_plain_us"), _micro(spec.switch.costs(len(prompts))), strict=True))
    return row, [list(o.token_ids) for o in outs]


@contextmanager
def serving_heap(freeze: bool) -> Iterator[None]:
    """The measured rounds run with the setup's heap frozen, as a serving worker's engine runs once it
    is built (engine/heap.py), so a full collection walks only what the rounds allocate; each round
    reports the collector's pauses (`gc_full_pause_ms`). Unfrozen on the way out: tests call main
    in-process."""
    if freeze:
        freeze_startup_heap()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()


def _micro(costs: tuple[float | None, float | None]) -> tuple[float, float]:
    return tuple(float("nan") if c is None else c * 1e6 for c in costs)  # type: ignore[return-value]


def measure_batch(
    arms: dict[str, LLM], prompts: list[list[int]], max_tokens: int, repeats: int, warmup_rounds: int = 1
) -> dict:
    """Each arm `repeats` times, round-robin (so drift on a shared machine spreads over every arm), the
    median of each figure; `exact`: every repeat's tokens equal plain's first. First `warmup_rounds`
    untimed rounds at this batch size: a serving engine meets a batch size once and then serves it for
    hours, so what the adaptive switch spends learning a new bucket (and first-call costs at new shapes)
    is reported apart, as `first_round_tpot_ms`, not mixed into the steady-state median."""
    samples: dict[str, list[dict]] = {name: [] for name in arms}
    first_round: dict[str, float] = {}
    reference, exact = None, dict.fromkeys(arms, True)
    names = list(arms)
    for round_index in range(warmup_rounds + repeats):
        for name in _rotated(names, round_index):
            row, tokens = measure(arms[name], prompts, max_tokens)
            reference = tokens if reference is None else reference
            exact[name] = exact[name] and tokens == reference
            if round_index == 0:
                first_round[name] = row["tpot_ms"]
            if round_index >= warmup_rounds:
                samples[name].append(row)
    return {
        name: {
            **{key: statistics.median(r[key] for r in rows) for key in rows[0] if key not in ("stalls", "pattern")},
            "stalls_runs": [r["stalls"] for r in rows],
            "pattern_runs": [r.get("pattern", "") for r in rows],
            "tpot_ms_runs": [r["tpot_ms"] for r in rows],
            "gc_full_pause_ms_runs": [r["gc_full_pause_ms"] for r in rows],
            "stall_ms_runs": [r["stall_ms"] for r in rows],
            "first_round_tpot_ms": first_round[name],
            "exact": exact[name],
        }
        for name, rows in samples.items()
    }


def _rotated(names: list[str], round_index: int) -> list[str]:
    """Round r starts at arm r (mod arms): no arm always runs right after the same one, or first."""
    at = round_index % len(names)
    return names[at:] + names[:at]


def add_ratios(rows: dict) -> dict:
    """Each arm's figures against the `plain` arm's, all > 1 where the arm does better than plain.
    `tpot_ratio` is plain's median over the arm's median; `tpot_ratio_paired` the median of the
    per-round ratios (each round's arms run back to back, so slow drift of the machine cancels)."""
    plain_runs = rows["plain"]["tpot_ms_runs"]
    for row in rows.values():
        row["tpot_ratio"] = rows["plain"]["tpot_ms"] / row["tpot_ms"]
        paired = [p / a for p, a in zip(plain_runs, row["tpot_ms_runs"], strict=True)]
        row["tpot_ratio_paired"] = statistics.median(paired)
        row["throughput_ratio"] = row["tokens_per_s"] / rows["plain"]["tokens_per_s"]
        row["first_round_tpot_ratio"] = rows["plain"]["first_round_tpot_ms"] / row["first_round_tpot_ms"]
    return rows


def handoff_catch_up(llm: LLM, prompt_tokens: int, repeats: int = 3) -> dict:
    """After a hand-off the decode side holds the target's prompt KV; the draft's must be computed there
    (one draft forward over the prompt) or sent along. Times that forward against the target's prefill
    of the same prompt, and reports the draft KV's bytes (what sending would move)."""
    engine, prompt = llm.engine, list(range(10, 10 + prompt_tokens))
    engine.kv.allocate("handoff-probe", prompt_tokens)
    try:
        chunk = DraftChunk(cast(Sequence, SimpleNamespace(seq_id="handoff-probe")), 0, prompt)  # only seq_id is read
        step = build_step_input([chunk], engine.kv.block_table, engine.config.block_size)
        timed = {}
        for name, runner in (("target_prefill_ms", engine.runner), ("draft_catch_up_ms", engine.spec.draft.runner)):
            runner.execute(step)
            started_s = time.perf_counter()
            for _ in range(repeats):
                runner.execute(step)
            timed[name] = (time.perf_counter() - started_s) / repeats * 1e3
    finally:
        engine.kv.free("handoff-probe")
    return {
        "prompt_tokens": prompt_tokens,
        **timed,
        "draft_kv_bytes": engine.spec.draft.runner.kv_cache.bytes_per_token * prompt_tokens,
    }


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else None
    common = {
        "progress": False,
        "num_kv_blocks": args.num_kv_blocks,
        "max_num_seqs": max(args.batches),
        "device": args.device,
        "dtype": args.dtype,
    }
    plain = LLM(model_dir, **common)
    model_dir = Path(plain.config.model_dir)
    draft_dir = truncated_copy(model_dir, args.draft_layers, Path(tempfile.mkdtemp(prefix="spec-draft-")))
    k = args.k
    ngram = {"method": "ngram", "num_speculative_tokens": k}
    draft = {"model": str(draft_dir), "num_speculative_tokens": k}
    arms = {
        "plain": plain,
        "ngram": LLM(model_dir, **common, speculative_config=ngram),
        "ngram-forced": LLM(model_dir, **common, speculative_config={**ngram, "adaptive": False}),
        "draft": LLM(model_dir, **common, speculative_config=draft),
        "draft-forced": LLM(model_dir, **common, speculative_config={**draft, "adaptive": False}),
    }
    if args.control:  # a second plain engine: its ratio to plain is this run's noise floor
        arms["plain-control"] = LLM(model_dir, **common)
    if args.int8_self_draft:  # the target itself, int8 weights (a draft that agrees often)
        self_draft = {"model": str(model_dir), "quantization": "int8", "num_speculative_tokens": k}
        arms["int8-self"] = LLM(model_dir, **common, speculative_config=self_draft)
        arms["int8-self-forced"] = LLM(model_dir, **common, speculative_config={**self_draft, "adaptive": False})
    prompts = repeat_workload(plain, max(args.batches), args.text_tokens, args.seed)
    for llm in arms.values():  # warm-up: first-call costs, and the adaptive switch's first measurements
        measure(llm, prompts[:1], 8)
    results = {"model": str(model_dir), "k": k, "draft_layers": args.draft_layers, "repeats": args.repeats}
    results["heap_frozen"] = not args.no_freeze_heap
    results["batches"] = {}
    with serving_heap(not args.no_freeze_heap):
        for batch in args.batches:
            rows = add_ratios(measure_batch(arms, prompts[:batch], args.max_tokens, args.repeats, args.warmup_rounds))
            results["batches"][batch] = rows
            _print(batch, rows)
    if args.handoff_prompt:
        results["handoff"] = handoff_catch_up(arms["draft-forced"], args.handoff_prompt)
        print(json.dumps(results["handoff"]))
    shutil.rmtree(draft_dir, ignore_errors=True)
    return results


def _print(batch: int, rows: dict) -> None:
    print(f"batch {batch}")
    print(
        f"  {'arm':16s} {'TPOT ms':>9s} {'x plain':>8s} {'paired':>7s} {'tok/s':>8s} {'x plain':>8s} {'accept':>7s} "
        f"{'spec steps':>10s} exact  {'first round x':>13s} {'gc ms':>6s} {'stall ms':>8s}"
    )
    for name, r in rows.items():
        print(
            f"  {name:16s} {r['tpot_ms']:9.2f} {r['tpot_ratio']:8.2f} {r['tpot_ratio_paired']:7.2f} "
            f"{r['tokens_per_s']:8.1f} "
            f"{r['throughput_ratio']:8.2f} {r.get('acceptance', float('nan')):7.2f} "
            f"{r.get('spec_step_share', float('nan')):10.2f} {r['exact']!s:5s}  {r['first_round_tpot_ratio']:13.2f} "
            f"{max(r['gc_full_pause_ms_runs']):6.0f} {max(r['stall_ms_runs']):8.1f}",
            flush=True,
        )


def add_common_arguments(parser: argparse.ArgumentParser, output_tokens: int) -> None:
    """The model, workload and measurement flags every speculative-decoding benchmark takes."""
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    parser.add_argument("--max-tokens", type=int, default=output_tokens)
    parser.add_argument("--text-tokens", type=int, default=output_tokens, help="tokens of X (and of G) per prompt")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (2 oversubscribes a shared 2-core box)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs per arm and batch, round-robin; medians")
    parser.add_argument(
        "--warmup-rounds", type=int, default=1, help="untimed rounds per batch first (reported as first round)"
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (a GPU machine)")
    parser.add_argument("--dtype", default="auto", help="model dtype (auto: the checkpoint's)")
    parser.add_argument(
        "--no-freeze-heap",
        action="store_true",
        help="leave the startup heap to the collector (serving workers freeze it: engine/heap.py)",
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, output_tokens=48)
    parser.add_argument("--handoff-prompt", type=int, default=512)
    parser.add_argument(
        "--control", action="store_true", help="also a second plain engine (its ratio: the noise floor)"
    )
    parser.add_argument(
        "--int8-self-draft", action="store_true", help="also arms drafting with the target's own int8 weights"
    )
    args = parser.parse_args(argv)
    results = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
