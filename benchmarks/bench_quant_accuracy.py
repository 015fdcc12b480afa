"""Accuracy of quantized engines against the unquantized one, same prompts, same run.

`splitserve bench-engine --accuracy [--model DIR] [--prompts N] [--max-tokens T] [--configs ...]`
(or `python -m benchmarks.bench_quant_accuracy`). The reference is the engine in the checkpoint's
dtype with `kv_cache_dtype=auto` and no weight quantization. It generates greedy continuations; then
every configuration is teacher-forced along them (engine/teacher_forcing.py: each continuation token
goes through a decode step over the paged cache, as in generation) and compared per step:

- mean / max absolute logit error;
- top-1 agreement: the configuration's argmax equals the reference's;
- KL(reference || configuration) of the next-token distributions, mean and max;
- greedy-sequence agreement: the configuration generating on its own, the length of its common
  prefix with the reference continuation (mean over prompts, and how many match in full).

`int8-weights-g128` / `-g32` keep one int8 scale per group of 128 / 32 inputs (`quantization_group_size`)
instead of per output channel. `int4-weights` rounds the checkpoint to group-wise int4 at load;
`int4-rtn-g64`, `int4-gptq-g64` and `int4-awq-g64` first write a quantized copy with `splitserve quantize`
(groups of 64, calibrated on the shipped corpus) and serve it with `quantization: int4`, so the three
quantizers compare on one grid.
`bf16-weights` (the checkpoint run in bfloat16) is printed as a yardstick: what the precision every
serving engine uses by default costs on the same checkpoint. Targets are printed beside the figures;
nothing is clipped or hidden.

Models: the demo checkpoint by default (random weights: nearly flat logits, so it is the worst case
for top-1 agreement, and bf16 alone flips ~1% of its argmaxes); `--trained` uses the small Llama
trained on the shipped corpus (benchmarks/trained_model.py), whose logits have a trained model's
margins. Prompts: random token ids (`--prompts-from random`, default) or windows of the shipped corpus
(`--prompts-from corpus`: text of the kind the trained model has seen).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from typing import Any

import torch
from transformers import AutoTokenizer

from benchmarks.trained_model import ensure_trained_model
from engine.config import EngineConfig
from engine.demo_model import corpus_text, ensure_demo_model
from engine.llm_engine import LLMEngine
from engine.model_loader import load_model_config
from engine.sampling_params import SamplingParams
from engine.teacher_forcing import teacher_forced_logits
from splitserve.quantize import main as quantize_main

CONFIGS: dict[str, dict[str, Any]] = {
    "int8-kv": {"kv_cache_dtype": "int8"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "int8-weights": {"quantization": "int8"},
    "int8-weights+lm-head": {"quantization": "int8", "quantize_lm_head": True},
    "int8-weights-g128": {"quantization": "int8", "quantization_group_size": 128},
    "int8-weights-g32": {"quantization": "int8", "quantization_group_size": 32},
    "int8-weights+int8-kv": {"quantization": "int8", "kv_cache_dtype": "int8"},
    "bf16-weights": {"dtype": "bfloat16"},
    "int4-weights": {"quantization": "int4"},
    # Checkpoints written by `splitserve quantize` (calibrated on the shipped corpus), served as int4.
    "int4-rtn-g64": {"quantize": ["--method", "rtn", "--bits", "4", "--group-size", "64", "--asym"]},
    "int4-gptq-g64": {"quantize": ["--method", "gptq", "--bits", "4", "--group-size", "64", "--asym"]},
    "int4-awq-g64": {"quantize": ["--method", "awq", "--bits", "4", "--group-size", "64"]},
}
QUANTIZED_CHECKPOINT_ENGINE = {"quantization": "int4"}
TOP1_TARGET = 0.99


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"g{index}", prompt, params)
    while engine.has_unfinished():
        engine.step()
    return [list(engine.pop_finished(f"g{index}").output_token_ids) for index in range(len(prompts))]


def compare(reference: torch.Tensor, logits: torch.Tensor) -> dict:
    """Per-step figures of one configuration's teacher-forced logits against the reference's."""
    error = (logits - reference).abs()
    log_p, log_q = reference.log_softmax(-1), logits.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {
        "mean_abs_logit_error": error.mean().item(),
        "max_abs_logit_error": error.max().item(),
        "top1_agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
    }


def agreement_lengths(reference: list[list[int]], generated: list[list[int]]) -> list[int]:
    lengths = []
    for ours, theirs in zip(generated, reference, strict=True):
        same = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
        )
        lengths.append(same)
    return lengths


def evaluate(model_dir: str, config_names: list[str], prompts: list[list[int]], max_tokens: int) -> dict:
    engine_args: dict[str, Any] = {"model_dir": model_dir, "num_kv_blocks": 2048, "max_num_seqs": len(prompts)}
    reference = LLMEngine(EngineConfig(**engine_args))
    continuations = greedy(reference, prompts, max_tokens)
    expected = torch.cat(teacher_forced_logits(reference, prompts, continuations))
    del reference
    report = {}
    scratch = tempfile.TemporaryDirectory()
    for name in config_names:
        settings = dict(CONFIGS[name])
        flags = settings.pop("quantize", None)
        if flags is not None:
            served = f"{scratch.name}/{name}"
            quantize_main([model_dir, served, *flags])
            settings = {"model_dir": served, **QUANTIZED_CHECKPOINT_ENGINE}
        engine = LLMEngine(EngineConfig(**{**engine_args, **settings}))
        row = compare(expected, torch.cat(teacher_forced_logits(engine, prompts, continuations)).float())
        lengths = agreement_lengths(continuations, greedy(engine, prompts, max_tokens))
        row.update(
            greedy_agreement_mean=sum(lengths) / len(lengths), greedy_full_matches=sum(n == max_tokens for n in lengths)
        )
        report[name] = row
        del engine
    scratch.cleanup()
    return report


def print_report(report: dict, num_prompts: int, max_tokens: int) -> None:
    print(f"\n{num_prompts} prompts x {max_tokens} teacher-forced steps; reference: fp32 weights, kv auto")
    print(
        f"{'config':<24}{'mean|dlogit|':>13}{'max|dlogit|':>12}{'top-1':>9}{'KL mean':>10}{'KL max':>9}"
        f"{'greedy agree':>14}{'full':>6}  top-1 target"
    )
    for name, row in report.items():
        verdict = (
            "yardstick" if name == "bf16-weights" else ("meets" if row["top1_agreement"] >= TOP1_TARGET else "MISSES")
        )
        print(
            f"{name:<24}{row['mean_abs_logit_error']:>13.5f}{row['max_abs_logit_error']:>12.4f}"
            f"{row['top1_agreement']:>9.4f}{row['kl_mean']:>10.2e}{row['kl_max']:>9.2e}"
            f"{row['greedy_agreement_mean']:>10.1f}/{max_tokens:<3}{row['greedy_full_matches']:>6}"
            f"  {verdict} >= {TOP1_TARGET}"
        )


def make_prompts(model_dir: str, args) -> list[list[int]]:
    """`args.prompts` prompts of `args.min_prompt`..`args.max_prompt` tokens: random ids (never EOS or
    BOS) or windows of the shipped corpus, tokenized by the model's tokenizer."""
    rng = random.Random(args.seed)
    if args.prompts_from == "corpus":
        ids = AutoTokenizer.from_pretrained(model_dir)(corpus_text(), verbose=False)["input_ids"]
        lengths = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.prompts)]
        starts = [rng.randrange(len(ids) - length) for length in lengths]
        return [ids[start : start + length] for start, length in zip(starts, lengths, strict=True)]
    model = load_model_config(model_dir)
    special = {*model.eos_token_ids, model.bos_token_id}
    vocab = [t for t in range(model.vocab_size) if t not in special]  # no id with a meaning (EOS, BOS)
    return [rng.choices(vocab, k=rng.randint(args.min_prompt, args.max_prompt)) for _ in range(args.prompts)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="splitserve bench-engine --accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    parser.add_argument("--trained", action="store_true", help="the model trained on the shipped corpus")
    parser.add_argument("--trained-steps", type=int, default=300, help="with --trained: its training steps")
    parser.add_argument("--prompts-from", choices=("random", "corpus"), default="random")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.configs.split(",")) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {list(CONFIGS)}")
    torch.set_num_threads(args.threads)
    model_dir = args.model or str(ensure_trained_model(args.trained_steps) if args.trained else ensure_demo_model())
    prompts = make_prompts(model_dir, args)
    report = evaluate(model_dir, args.configs.split(","), prompts, args.max_tokens)
    print_report(report, args.prompts, args.max_tokens)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "model")}
        result = {"settings": settings, "model": "trained" if args.trained or args.model else "demo", "report": report}
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
            handle.write("\n")
    return report


if __name__ == "__main__":
    main()
