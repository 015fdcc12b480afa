"""Offline throughput: our engine (continuous batching) vs `transformers` `generate`, same run and requests.

1. Requests: random token ids, prompt lengths uniform in [min_prompt, max_prompt], max_tokens uniform in
   [min_output, max_output], one seeded generator; EOS ignored on both sides; fp32 on CPU.
2. Engine: all requests go to `LLM.generate` at once; output tokens/s = generated tokens / wall time.
3. HF: greedy `generate`, left padding, no EOS, requests in arrival order in batches of B. A batch runs
   to its largest max_tokens, but only each request's own max_tokens count as useful output (exactly
   what the engine produces): padding and overrun are HF's real cost of static batching. B is HF's best
   of `--hf-batch-sizes` in useful tokens/s on the first `--calibration-requests` requests.
4. HF then runs the first `--hf-sample` requests at that B, reusing the calibration run for the first
   ones. HF batches are independent and lengths i.i.d., so a prefix's rate estimates the full set's.
   Default 128, half the set (~17k useful tokens, four batches even at B=32): on 2 cores the
   calibration takes ~3-4 min, each further 32 requests 1-2 (B=1: ~3), the engine ~2.5: ~10-15 min.
   Other load on the machine slows both sides (badly): the summary records the load average.

`--check N`: engine greedy tokens vs unbatched HF for the first N requests (reusing B=1 calibration).
`--profile`: only the engine, on `--profile-requests` requests, under cProfile: top functions, and
self time per source file with torch builtins charged to their callers.
The HF runner is benchmarks/hf_baseline.py; the request and throughput record, benchmarks/throughput.py.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.hf_baseline import HFBaseline, check_tokens
from benchmarks.throughput import BenchRequest, Throughput
from engine import LLM, SamplingParams, kernels
from engine.demo_model import ensure_demo_model
from engine.model_loader import load_model_config

TARGET_RATIO = 3.0


@dataclass(frozen=True)
class BenchConfig:
    """Every field is the CLI flag of the same name (`--num-requests`), except `--model` and `--json`."""

    model_dir: str | None = None  # None: the demo checkpoint
    num_requests: int = 256
    min_prompt: int = 16
    max_prompt: int = 512
    min_output: int = 16
    max_output: int = 256
    seed: int = 0
    threads: int = len(os.sched_getaffinity(0))
    hf_batch_sizes: tuple[int, ...] = (1, 8, 32)
    calibration_requests: int = 32  # a multiple of every B, so the chosen B's run is reusable
    hf_sample: int = 128
    check: int = 0
    profile: bool = False
    profile_requests: int = 32
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    json_path: str | None = None

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is int and value < (0 if f.name in ("seed", "check") else 1):
                raise ValueError(f"--{f.name.replace('_', '-')} must be >= 1 (--seed, --check: >= 0)")
        if (
            self.min_prompt > self.max_prompt
            or self.min_output > self.max_output
            or min(self.hf_batch_sizes, default=0) < 1
        ):
            raise ValueError("each --min-* must be <= its --max-*, and --hf-batch-sizes positive integers")


def make_requests(cfg: BenchConfig, vocab_size: int, special_ids: set[int]) -> list[BenchRequest]:
    # Special ids stay out of prompts so no runner can give them a meaning (BOS reset, EOS stop).
    vocab = [t for t in range(vocab_size) if t not in special_ids]
    rng = random.Random(cfg.seed)
    return [
        BenchRequest(
            tuple(rng.choices(vocab, k=rng.randint(cfg.min_prompt, cfg.max_prompt))),
            rng.randint(cfg.min_output, cfg.max_output),
        )
        for _ in range(cfg.num_requests)
    ]


def run_engine(llm: LLM, requests: list[BenchRequest], use_tqdm: bool = True):
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    start_s = time.perf_counter()
    outputs = llm.generate([list(r.prompt_token_ids) for r in requests], params, use_tqdm=use_tqdm)
    wall_s = time.perf_counter() - start_s
    tokens = [list(out.token_ids) for out in outputs]
    if [len(t) for t in tokens] != [r.max_tokens for r in requests]:
        raise RuntimeError("the engine did not produce exactly max_tokens for every request")
    return Throughput.of(requests, sum(map(len, tokens)), wall_s), tokens


def run_hf(cfg: BenchConfig, requests: list[BenchRequest]):
    """Calibrates B, then measures the sample at the best B; returns (hf, calibration, best B, result)."""
    assert cfg.model_dir is not None, "main() resolves it"
    hf, calibration = HFBaseline(cfg.model_dir), {}
    for size in cfg.hf_batch_sizes:  # the same first requests for every B
        calibration[size] = hf.run(requests[: cfg.calibration_requests], size)
        _log(f"HF calibration B={size}: {calibration[size][0].output_tokens_per_s:.1f} useful tok/s")
    best = max(calibration, key=lambda size: calibration[size][0].output_tokens_per_s)
    sample, (reused, _) = requests[: cfg.hf_sample], calibration[best]
    _log(f"HF: B={best} on the first {len(sample)} requests")
    if reused.num_requests > len(sample) or reused.num_requests % best:
        return hf, calibration, best, hf.run(sample, best)[0]
    # The calibration already ran the sample's first requests at this B, in the same batches.
    return hf, calibration, best, reused + hf.run(sample[reused.num_requests :], best)[0]


def profile_engine(llm, requests: list[BenchRequest], top: int = 25) -> dict:
    profiler = cProfile.Profile()
    profiler.enable()
    result, _ = run_engine(llm, requests, use_tqdm=False)
    profiler.disable()
    stats = pstats.Stats(profiler)
    for key in ("cumulative", "tottime"):
        print(f"\n=== top {top} functions by {key} time ===")
        stats.sort_stats(key).print_stats(top)
    by_file = self_time_by_file(stats)
    total_s = sum(by_file.values())
    print(f"=== self time by source file (builtins charged to their caller), {total_s:.1f} s ===")
    for name, seconds in sorted(by_file.items(), key=lambda item: -item[1])[:top]:
        print(f"{seconds:9.2f} s {100 * seconds / total_s:5.1f} %  {name}")
    print(f"engine: {result.output_tokens_per_s:.1f} output tok/s under the profiler, {result.wall_s:.1f} s")
    return {"engine": result.to_json(), "self_time_by_file_s": dict(by_file)}


def self_time_by_file(stats: pstats.Stats) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    # Stats.stats is pstats' own table (undocumented, so typeshed leaves it out).
    for (file, _, name), (_, _, self_s, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if file != "~":
            totals[_short(file)] += self_s
            continue
        # A builtin (torch op) has no file: charge its callers' files, so attention's gathers show apart.
        for (caller_file, _, _), caller_stats in callers.items():
            totals[f"{_short(caller_file)} -> {name}"] += caller_stats[2]
    return totals


def _short(file: str) -> str:  # from the package root (engine/..., torch/...): same on every machine
    file = file.rsplit("site-packages/", 1)[-1]
    return file[file.rfind("/engine/") + 1 :] if "/engine/" in file else file


def print_report(engine: Throughput, hf: Throughput, batch_size: int, calibration: dict) -> None:
    print(f"\n{'runner':<40}{'requests':>9}{'out tok':>9}{'wall s':>9}{'out tok/s':>11}{'total tok/s':>13}")
    for name, t in (("splitserve engine (continuous batching)", engine), (f"HF generate, B={batch_size}", hf)):
        print(
            f"{name:<40}{t.num_requests:>9}{t.output_tokens:>9}{t.wall_s:>9.1f}"
            f"{t.output_tokens_per_s:>11.1f}{t.total_tokens_per_s:>13.1f}"
        )
    ratio = engine.output_tokens_per_s / hf.output_tokens_per_s
    print(
        f"ratio engine / HF output tok/s: {ratio:.2f}x ({'meets' if ratio >= TARGET_RATIO else 'misses'} "
        f"the {TARGET_RATIO:.0f}x target)"
    )
    print(
        f"\nHF calibration on the first {next(iter(calibration.values()))[0].num_requests} requests:\n"
        f"{'B':>4}{'wall s':>9}{'useful tok/s':>14}{'decoded tok/s':>15}{'useful %':>10}"
    )
    for size, (t, _) in calibration.items():
        print(
            f"{size:>4}{t.wall_s:>9.1f}{t.output_tokens_per_s:>14.1f}{t.computed_output_tokens / t.wall_s:>15.1f}"
            f"{100 * t.output_tokens / t.computed_output_tokens:>10.1f}"
        )


def parse_args(argv: list[str] | None) -> BenchConfig:
    parser = argparse.ArgumentParser(prog="splitserve bench-engine", description=__doc__.splitlines()[0])
    for f in fields(BenchConfig):
        flag = {"model_dir": "--model", "json_path": "--json"}.get(f.name, "--" + f.name.replace("_", "-"))
        if f.default is False:
            parser.add_argument(flag, dest=f.name, action="store_true")
        elif isinstance(f.default, tuple):
            parser.add_argument(
                flag,
                dest=f.name,
                default=f.default,
                help="comma-separated",
                type=lambda text: tuple(int(item) for item in text.split(",")),
            )
        else:
            parser.add_argument(flag, dest=f.name, default=f.default, type=str if f.default is None else int)
    return BenchConfig(**vars(parser.parse_args(argv)))


def _log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; returns the summary (also written to `--json`)."""
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    if cfg.model_dir is None:
        cfg = replace(cfg, model_dir=str(ensure_demo_model()))
    assert cfg.model_dir is not None
    model = load_model_config(cfg.model_dir)
    if cfg.max_prompt + cfg.max_output > model.max_position_embeddings:
        raise ValueError(f"max prompt + output exceeds the model's {model.max_position_embeddings} positions")
    special = {*model.eos_token_ids, *(() if model.bos_token_id is None else (model.bos_token_id,))}
    requests = make_requests(cfg, model.vocab_size, special)
    summary: dict[str, Any] = {"config": asdict(cfg), "torch": torch.__version__, "load_average_start": os.getloadavg()}
    # num_threads is not passed: the bench sets torch's thread count once, for both sides.
    llm = LLM(
        cfg.model_dir, progress=False, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens
    )
    run_engine(llm, [BenchRequest((5, 6, 7, 8), 2)], use_tqdm=False)  # warm-up, outside the timing
    # The C kernels the warm-up loaded, each with the instruction-set variant this CPU runs.
    summary["kernel_variants"] = kernels.loaded_variants()
    _log("C kernels: " + (", ".join(f"{k} {v}" for k, v in summary["kernel_variants"].items()) or "none loaded"))
    if cfg.profile:
        summary["profile"] = profile_engine(llm, requests[: cfg.profile_requests])
        return _finish(summary, cfg)
    _log(f"engine: {len(requests)} requests, {cfg.threads} threads")
    engine, engine_tokens = run_engine(llm, requests)
    _log(f"engine: {engine.output_tokens_per_s:.1f} output tok/s, {engine.wall_s:.1f} s")
    del llm  # frees the KV cache before HF allocates its own
    hf, calibration, best, hf_result = run_hf(cfg, requests)
    print_report(engine, hf_result, best, calibration)
    summary.update(
        engine=engine.to_json(),
        hf={**hf_result.to_json(), "batch_size": best},
        ratio=engine.output_tokens_per_s / hf_result.output_tokens_per_s,
        target_ratio=TARGET_RATIO,
        calibration=[{"batch_size": b, **t.to_json()} for b, (t, _) in calibration.items()],
    )
    if cfg.check:
        known = calibration[1][1] if 1 in calibration else []
        check = summary["check"] = check_tokens(hf, requests[: cfg.check], engine_tokens, known)
        print(
            f"check: {check['num_identical']}/{check['num_requests']} requests token-identical to unbatched HF"
            + ("" if check["passed"] else f"; first divergence {check['first_divergence_by_request']}")
        )
    return _finish(summary, cfg)


def _finish(summary: dict, cfg: BenchConfig) -> dict:
    summary["load_average_end"] = os.getloadavg()
    print(
        f"load average (1 min) at start / end: {summary['load_average_start'][0]:.1f} / "
        f"{summary['load_average_end'][0]:.1f} on {len(os.sched_getaffinity(0))} cores"
    )
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


if __name__ == "__main__":
    main()
