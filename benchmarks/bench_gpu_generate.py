"""Engine output tokens/s against HF `generate` on the same GPU, checkpoint, prompts and dtype.

A 1B-class random-weight Llama (benchmarks/bench_gpu_decode.py builds it), `num_prompts` prompts of
`prompt_len` random tokens, `max_tokens` greedy tokens each with EOS ignored: both sides produce
exactly num_prompts x max_tokens tokens. HF runs one left-padded batch (its default dynamic cache,
SDPA attention); the engine runs `LLM.generate` (continuous batching, paged KV, CUDA graphs). Each
side gets one warm-up call first. Needs CUDA.

`python -m benchmarks.bench_gpu_generate --out generate.json`
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from benchmarks.bench_gpu_decode import build_checkpoint
from engine import LLM, SamplingParams


def hf_tokens_per_s(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> float:
    # transformers wraps PreTrainedModel.to in a decorator whose signature mypy misreads.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda").eval()  # type: ignore[arg-type]
    model.generation_config = GenerationConfig(pad_token_id=0)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.cuda(), mask.cuda()

    def run(model, new_tokens: int) -> None:  # model passed in: `del model` below must free it
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
            )

    run(model, 4)
    torch.cuda.synchronize()
    start = time.perf_counter()
    run(model, max_tokens)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return len(prompts) * max_tokens / elapsed


def engine_tokens_per_s(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> float:
    llm = LLM(
        model_dir,
        progress=False,
        device="cuda",
        max_num_seqs=len(prompts),
        max_model_len=2048,
        num_kv_blocks=len(prompts) * 2048 // 16 + 16,
    )
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(prompts) * max_tokens
    return len(prompts) * max_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_generate.json")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp) / "llama-1b")
        ours = engine_tokens_per_s(model_dir, prompts, args.max_tokens)
        hf = hf_tokens_per_s(model_dir, prompts, args.max_tokens)
    result = {
        "device": torch.cuda.get_device_name(),
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "engine_tokens_per_s": ours,
        "hf_tokens_per_s": hf,
        "speedup": ours / hf,
    }
    print(
        f"generate {args.num_prompts}x({args.prompt_len}+{args.max_tokens}): engine {ours:.0f} tok/s, "
        f"HF {hf:.0f} tok/s -> {ours / hf:.2f}x",
        flush=True,
    )
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
