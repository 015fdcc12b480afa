"""A tiny checkpoint trained to answer given prompts with given texts: real model output for tests of
output parsing (tool calls, reasoning) that random weights never produce.

A 2-layer Llama (transformers' own classes, the factories' tokenizer) is trained with Adam on CPU, the
loss on the answers only, until HF's greedy `generate` reproduces every answer and then EOS; serving it
in fp32 gives the same tokens (the engine's exactness tests hold it to HF).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from engine.demo_model import SPECIAL_TOKEN_IDS
from tests.factories import TinySpec, _hf_config, _tokenizer

SPEC = TinySpec(max_position_embeddings=512)
MAX_STEPS = 600


def scripted_tokenizer():
    """The tokenizer the scripted checkpoint is saved with (render its prompts with this)."""
    return _tokenizer(SPEC.vocab_size, SPEC.max_position_embeddings)


def make_scripted_checkpoint(out_dir: Path, scripts: list[tuple[str, str]], seed: int = 0) -> Path:
    """`scripts`: (prompt text, answer text); the prompt is encoded without special tokens added (a chat
    template writes them), the answer is followed by EOS."""
    tokenizer = scripted_tokenizer()
    eos = SPECIAL_TOKEN_IDS["eos_token_id"]
    pairs = [(tokenizer.encode(p, add_special_tokens=False), tokenizer.encode(a, add_special_tokens=False) + [eos])
             for p, a in scripts]
    torch.manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(_hf_config(SPEC), dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), width), SPECIAL_TOKEN_IDS["pad_token_id"])
    labels = torch.full((len(pairs), width), -100)
    for row, (prompt, answer) in enumerate(pairs):
        ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[row, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
    model.train()
    for step in range(MAX_STEPS):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 25 == 24 and loss.item() < 1e-2 and _reproduces(model, pairs):
            break
    else:
        raise AssertionError(f"the scripted model did not learn its answers in {MAX_STEPS} steps (loss {loss.item()})")
    model.eval()
    model.generation_config = GenerationConfig(**SPECIAL_TOKEN_IDS)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    return Path(out_dir)


def _reproduces(model, pairs) -> bool:
    model.eval()
    try:
        with torch.no_grad():
            for prompt, answer in pairs:
                out = model.generate(torch.tensor([prompt]), max_new_tokens=len(answer) + 2, do_sample=False,
                                     **SPECIAL_TOKEN_IDS)
                if out[0, len(prompt) :].tolist() != answer:
                    return False
        return True
    finally:
        model.train()
