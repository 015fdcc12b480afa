"""`python -m engine.demo`: offline generation on the demo checkpoint, printing text and timings.

What `make run` does until the router serves requests (it generates the demo model on first use).
"""

from __future__ import annotations

import argparse
import time

from engine import LLM, SamplingParams

DEFAULT_PROMPTS = (
    "The prefill worker computes the prompt's cache and",
    "A scheduler that batches requests continuously",
    "Once upon a time, a small language model",
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompts", nargs="*", default=list(DEFAULT_PROMPTS))
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    started_s = time.perf_counter()
    llm = LLM(args.model)
    print(f"model loaded in {time.perf_counter() - started_s:.1f} s from {llm.config.model_dir}")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    started_s = time.perf_counter()
    outputs = llm.generate(args.prompts, params)
    wall_s = time.perf_counter() - started_s
    for out in outputs:
        tpot = out.metrics.tpot_s
        print(f"\n> {out.prompt}\n{out.text!r}")
        print(
            f"  {len(out.token_ids)} tokens, finish={out.finish_reason}, TTFT {out.ttft_s * 1e3:.0f} ms, "
            f"TPOT {'-' if tpot is None else f'{tpot * 1e3:.1f} ms'}"
        )
    total = sum(len(o.token_ids) for o in outputs)
    print(f"\n{total} tokens in {wall_s:.2f} s ({total / wall_s:.1f} tokens/s)")


if __name__ == "__main__":
    main()
