"""benchmarks/trained_model.py: a few training steps lower the loss and write a checkpoint the engine
serves exactly as HF does; the corpus prompts of bench_quant_accuracy are windows of the corpus."""
from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from benchmarks import bench_quant_accuracy as accuracy
from benchmarks import trained_model
from engine import LLM, SamplingParams
from engine.demo_model import corpus_text


def test_lr_warms_up_then_decays_to_a_tenth():
    steps = 200
    rates = [trained_model._lr(step, steps) for step in range(steps + 1)]
    assert rates[0] < rates[trained_model.WARMUP_STEPS] == trained_model.PEAK_LR
    decay = rates[trained_model.WARMUP_STEPS :]
    assert all(a >= b for a, b in itertools.pairwise(decay))
    assert abs(rates[-1] - 0.1 * trained_model.PEAK_LR) < 1e-9


def test_training_writes_a_checkpoint_the_engine_serves_exactly(tmp_path):
    torch.set_num_threads(1)
    lines = []
    out = trained_model.train(steps=6, seed=0, out_dir=tmp_path / "trained", log=lines.append)
    marker = json.loads((out / trained_model.MARKER).read_text())
    losses = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert marker["steps"] == 6 and losses[-1] < losses[0]
    prompt = AutoTokenizer.from_pretrained(out)("The prefill worker")["input_ids"]
    hf = LlamaForCausalLM.from_pretrained(out).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = LLM(str(out), progress=False, num_kv_blocks=64).generate([prompt], params, use_tqdm=False)[0]
    assert list(got.token_ids) == expected


def test_corpus_prompts_are_windows_of_the_corpus(checkpoint):
    from tests.factories import TinySpec

    model_dir = checkpoint(TinySpec())
    args = SimpleNamespace(seed=0, prompts=4, min_prompt=5, max_prompt=9, prompts_from="corpus")
    ids = AutoTokenizer.from_pretrained(model_dir)(corpus_text())["input_ids"]
    text = "," + ",".join(map(str, ids)) + ","
    for prompt in accuracy.make_prompts(str(model_dir), args):
        assert 5 <= len(prompt) <= 9 and "," + ",".join(map(str, prompt)) + "," in text
