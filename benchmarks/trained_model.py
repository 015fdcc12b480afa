"""A small Llama trained on the shipped corpus, for figures that a random-weight model cannot give.

The demo checkpoint's weights are random: its next-token logits are nearly flat, top-1 and top-2
often differ by a hair, so any perturbation (bf16 rounding, int8 weights) flips the argmax at a few
percent of steps, something no trained model does. Accuracy figures (bench_quant_accuracy) are
therefore reported on this model as well: the demo model's tokenizer and architecture family (Llama,
GQA, tied embeddings), shrunk, trained for `steps` AdamW steps on windows of `engine/data/
demo_corpus.txt` (about 12k tokens, so it learns the corpus's statistics well: loss is printed).

`python -m benchmarks.trained_model [--steps N] [--out DIR]` builds it (minutes on 2 cores) and
prints where; `ensure_trained_model()` returns the cached copy, building it on first use, under
~/.cache/splitserve/trained-v{VERSION}-{steps}steps-seed{seed} ($SPLITSERVE_TRAINED_MODEL_DIR
overrides the root). Deterministic for a given (version, steps, seed, thread count) on the pinned torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaForCausalLM

from engine.demo_model import SPECIAL_TOKEN_IDS, DemoShape, corpus_text, demo_config, train_tokenizer

TRAINED_MODEL_VERSION = 1
SHAPE = DemoShape(
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    intermediate_size=768,
)
WINDOW_TOKENS = 128
BATCH_WINDOWS = 16
PEAK_LR = 3e-3
WARMUP_STEPS = 20
MARKER = "trained.json"


def _lr(step: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(steps - WARMUP_STEPS, 1)
    return PEAK_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(steps: int, seed: int, out_dir: Path, log=print) -> Path:
    tokenizer = train_tokenizer(SHAPE.target_vocab_size, SHAPE.max_position_embeddings)
    ids = torch.tensor(tokenizer(corpus_text(), verbose=False)["input_ids"])  # one long text, windowed below
    config = demo_config(len(tokenizer), SHAPE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.01)
        started_s = time.monotonic()
        for step in range(steps):
            starts = torch.randint(0, len(ids) - WINDOW_TOKENS, (BATCH_WINDOWS,))
            batch = torch.stack([ids[s : s + WINDOW_TOKENS] for s in starts.tolist()])
            for group in optimizer.param_groups:
                group["lr"] = _lr(step, steps)
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step % 25 == 0 or step == steps - 1:
                log(f"[trained-model {time.monotonic() - started_s:6.1f}s] step {step:4d} loss {loss.item():.3f}")
    model.eval()
    model.generation_config = GenerationConfig(**SPECIAL_TOKEN_IDS)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    marker = {"version": TRAINED_MODEL_VERSION, "steps": steps, "seed": seed, "final_loss": loss.item()}
    (out_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def trained_model_dir(steps: int, seed: int) -> Path:
    root = os.environ.get("SPLITSERVE_TRAINED_MODEL_DIR") or Path.home() / ".cache" / "splitserve"
    return Path(root).expanduser() / f"trained-v{TRAINED_MODEL_VERSION}-{steps}steps-seed{seed}"


def ensure_trained_model(steps: int = 300, seed: int = 0) -> Path:
    """The cached trained checkpoint, trained first if missing (built aside, then moved into place)."""
    target = trained_model_dir(steps, seed)
    if (target / MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        train(steps, seed, staging, log=lambda line: print(line, file=sys.stderr, flush=True))
        if not (target / MARKER).exists():
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write here instead of the cache")
    args = parser.parse_args(argv)
    path = train(args.steps, args.seed, Path(args.out)) if args.out else ensure_trained_model(args.steps, args.seed)
    print(path)


if __name__ == "__main__":
    main()
