"""Where a speculative engine's step time goes: cProfile of one batch (host-side view), and what it
spends beyond the plain engine.

`python -m benchmarks.profile_spec_step [--device cuda] [--batch 64] [--dtype float32] [--arm draft]`:
the demo model, the repeat workload of benchmarks/bench_spec.py; prints the plain and speculative
TPOT, the functions with the most own time in a profiled speculative run and, per function, the own
time it took beyond the same profiled round of the plain engine (`--arm draft`: the 2-layer truncated
draft with the adaptive switch on, which at batch 1 and 64 decodes plainly: what a spec-enabled engine
costs when it does not speculate; on a GPU, time the host waits for the device lands in the function
that synchronises, often the sampler's copy to the host).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import tempfile
from pathlib import Path

from benchmarks.bench_spec import measure, repeat_workload, truncated_copy
from engine import LLM


def _profile(llm: LLM, prompts: list[list[int]], max_tokens: int) -> pstats.Stats:
    profile = cProfile.Profile()
    profile.enable()
    measure(llm, prompts, max_tokens)
    profile.disable()
    return pstats.Stats(profile, stream=io.StringIO())


def _own_time_s(stats: pstats.Stats) -> dict[str, tuple[int, float]]:
    """(calls, own seconds) per 'file:line(function)'."""
    out = {}
    for (path, line, name), (_, calls, own_s, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        out[f"{'/'.join(Path(path).parts[-2:])}:{line}({name})"] = (calls, own_s)
    return out


def print_excess(spec: pstats.Stats, plain: pstats.Stats, top: int) -> None:
    """The functions whose own time grew most from the plain round to the speculative one."""
    a, b = _own_time_s(spec), _own_time_s(plain)
    rows = sorted(((a[k][1] - b.get(k, (0, 0.0))[1], k) for k in a), reverse=True)[:top]
    print(f"{'extra ms':>9} {'calls':>7} {'plain calls':>11}  function")
    for extra_s, key in rows:
        print(f"{extra_s * 1e3:9.2f} {a[key][0]:7d} {b.get(key, (0, 0))[0]:11d}  {key}")
    total = sum(s for _, s in a.values()) - sum(s for _, s in b.values())
    print(f"{total * 1e3:9.2f} in all")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--arm", choices=("ngram-forced", "draft"), default="ngram-forced")
    args = parser.parse_args(argv)
    common = {"progress": False, "num_kv_blocks": 4096, "max_num_seqs": args.batch, "device": args.device}
    common["dtype"] = args.dtype
    plain = LLM(None, **common)
    draft_dir = None
    if args.arm == "draft":
        draft_dir = truncated_copy(Path(plain.config.model_dir), 2, Path(tempfile.mkdtemp(prefix="spec-draft-")))
        config = {"model": str(draft_dir), "num_speculative_tokens": 4}
    else:
        config = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    spec = LLM(None, **common, speculative_config=config)
    prompts = repeat_workload(plain, args.batch, 48, 0)
    for name, llm in (("plain", plain), (args.arm, spec)):
        measure(llm, prompts, args.max_tokens)
        print(name, f"TPOT {measure(llm, prompts, args.max_tokens)[0]['tpot_ms']:.3f} ms", flush=True)
    plain_stats, spec_stats = _profile(plain, prompts, args.max_tokens), _profile(spec, prompts, args.max_tokens)
    out = io.StringIO()
    spec_stats.stream = out  # type: ignore[attr-defined]
    spec_stats.sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    print_excess(spec_stats, plain_stats, args.top)
    if draft_dir is not None:
        shutil.rmtree(draft_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
