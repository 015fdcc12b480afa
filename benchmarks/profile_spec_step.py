"""Where a speculative engine's step time goes: cProfile of one batch (host-side view).

`python -m benchmarks.profile_spec_step [--device cuda] [--batch 64] [--dtype float32]`: the demo model,
prompt-lookup speculation forced on every step, the repeat workload of benchmarks/bench_spec.py; prints
the plain and speculative TPOT and the functions with the most own time in a profiled speculative run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

from benchmarks.bench_spec import measure, repeat_workload
from engine import LLM


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    common = {"progress": False, "num_kv_blocks": 4096, "max_num_seqs": args.batch, "device": args.device}
    common["dtype"] = args.dtype
    plain = LLM(None, **common)
    spec = LLM(None, **common, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    prompts = repeat_workload(plain, args.batch, 48, 0)
    for name, llm in (("plain", plain), ("ngram-forced", spec)):
        measure(llm, prompts, args.max_tokens)
        print(name, f"TPOT {measure(llm, prompts, args.max_tokens)[0]['tpot_ms']:.2f} ms", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    measure(spec, prompts, args.max_tokens)
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
