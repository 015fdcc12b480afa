"""The MoE load-balance worker metric: the engine counts, per MoE layer, the tokens routed to each expert
exactly as HF's router chooses them over the same tokens; a worker's metrics turn the counts into a
per-expert counter and a per-layer imbalance gauge, served over HTTP in a form `promtool check metrics`
accepts."""
from __future__ import annotations

import shutil
import subprocess
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.metrics_http import scrape
from common.worker_metrics import WorkerMetrics
from engine import SamplingParams
from engine.models.moe import expert_token_counts
from tests.factories import random_prompts
from tests.moe_factories import make_moe_checkpoint, moe_spec

P = "splitserve_worker_"
DECODE = (("role", "decode"), ("worker", "decode-0"))


def _layer(layer: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((*DECODE, ("layer", layer))))


SPEC = moe_spec("qwen3_moe", seed=2, num_layers=3, num_experts=8, num_experts_per_tok=2, mlp_only_layers=(1,))


def _hf_counts(model_dir, sequences: list[list[int]]) -> dict[int, list[int]]:
    """Tokens per expert of each MoE layer as HF's routers pick them over `sequences`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    moe_layers = [i for i in range(SPEC.num_layers) if i != 1]
    totals = {layer: torch.zeros(8, dtype=torch.int64) for layer in moe_layers}
    with torch.no_grad():
        for tokens in sequences:
            logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
            for layer, layer_logits in zip(moe_layers, logits, strict=True):
                chosen = torch.topk(torch.softmax(layer_logits.float(), dim=-1), 2, dim=-1)[1]
                totals[layer] += torch.bincount(chosen.view(-1), minlength=8)
    return {layer: counts.tolist() for layer, counts in totals.items()}


def test_engine_counts_the_tokens_hf_routes_to_each_expert(make_llm, tmp_path):
    model_dir = make_moe_checkpoint(tmp_path, SPEC)
    prompts = random_prompts(3, 5, 30, 512, seed=21)
    llm = make_llm(model_dir, num_kv_blocks=64, enable_prefix_caching=False, prefill_chunk_tokens=8)
    assert expert_token_counts(llm.engine.runner.model) == {0: [0] * 8, 2: [0] * 8}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    # The engine ran every prompt token and every output token but the last through the model.
    computed = [prompt + out[:-1] for prompt, out in zip(prompts, outputs, strict=True)]
    counts = expert_token_counts(llm.engine.runner.model)
    assert counts == _hf_counts(model_dir, computed)
    assert all(sum(row) == 2 * sum(map(len, computed)) for row in counts.values())  # top-2


def test_worker_exports_tokens_per_expert_and_layer_imbalance(metrics_exporter):
    mount, server = metrics_exporter
    metrics = WorkerMetrics("decode-0", "decode")
    mount.register(metrics.registry)
    try:
        assert not any(name.startswith(P + "moe_") for name, _ in scrape(server.url))  # dense: no series
        metrics.set_expert_load({0: [3, 1, 0, 0], 2: [1, 1, 1, 1]})
        metrics.set_expert_load({0: [5, 3, 0, 0], 2: [1, 1, 1, 9]})  # since the first: [2, 2, 0, 0], [0, 0, 0, 8]
        samples = scrape(server.url)
        tokens = {dict(labels)["expert"]: value for (name, labels), value in samples.items()
                  if name == P + "moe_expert_tokens_total"}
        assert tokens == {"0": 6, "1": 4, "2": 1, "3": 9}
        assert samples[(P + "moe_load_imbalance", _layer("0"))] == 2.0  # max 2 over mean 1
        assert samples[(P + "moe_load_imbalance", _layer("2"))] == 4.0
        metrics.set_expert_load({0: [5, 3, 0, 0], 2: [1, 1, 1, 9]})  # nothing routed since: held
        assert scrape(server.url)[(P + "moe_load_imbalance", _layer("0"))] == 2.0
        assert metrics.snapshot()["moe_expert_tokens_total"] == {"0": 6, "1": 4, "2": 1, "3": 9}
        promtool = shutil.which("promtool")
        if promtool is None:
            pytest.fail("promtool is not installed: run scripts/install_prometheus.sh (make test-deps)")
        with urllib.request.urlopen(server.url, timeout=10) as response:
            text = response.read()
        checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        mount.unregister(metrics.registry)
