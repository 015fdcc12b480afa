"""Roofline profiles: step costs of a named model on a named GPU from datasheet figures, no GPU needed.

A step is bound by the larger of reading the weights (HBM bandwidth) and the matmuls (tensor-core
FLOP/s), each at a stated efficiency, plus a fixed per-step cost (scheduling, kernel launches).
Prefill attention is compute (4 * heads * head_dim FLOPs per causal pair and layer); decode attention
reads each context token's KV once (bandwidth). Tensor parallelism splits weights, KV and FLOPs over
the ranks and adds two all-reduces of the step's activations per layer over NVLink. KV capacity is
the HBM left after the weights at `memory_utilization`. The KV hand-off between a prefill and a
decode GPU goes over the node's RDMA NIC.

Every profile made here is `kind: roofline` and its label says "roofline": predictions from it are
estimates of what a tuned engine could do on that GPU, not measurements.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sim.profile import ModelFacts, Overheads, Profile, Transfer
from sim.step_cost import StepCost

KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_flops: float  # dense tensor-core FLOP/s
    hbm_bytes_per_s: float
    hbm_bytes: float
    nvlink_bytes_per_s: float  # per direction, per GPU
    nic_bytes_per_s: float  # RDMA to another node, per GPU
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    attention_efficiency: float = 0.5
    step_overhead_s: float = 0.002  # scheduling, sampling, launches per step
    memory_utilization: float = 0.9


GPUS = {
    "h100": Gpu("NVIDIA H100 SXM 80GB", 989e12, 3.35e12, 80e9, 450e9, 50e9),
    "h200": Gpu("NVIDIA H200 SXM 141GB", 989e12, 4.8e12, 141e9, 450e9, 50e9),
    "a100": Gpu("NVIDIA A100 SXM 80GB", 312e12, 2.04e12, 80e9, 300e9, 25e9),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_model_len: int
    tied_embeddings: bool = False
    bytes_per_param: int = 2  # bf16

    @property
    def body_params(self) -> int:
        attention = (
            self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        )
        return self.layers * (attention + 3 * self.hidden * self.intermediate)

    @property
    def params(self) -> int:
        return self.body_params + self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


MODELS = {
    "llama-3.2-1b": ModelShape("Llama-3.2-1B", 2048, 16, 32, 8, 64, 8192, 128256, 131072, tied_embeddings=True),
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 4096, 32, 32, 8, 128, 14336, 128256, 131072),
    "qwen2.5-7b": ModelShape("Qwen2.5-7B", 3584, 28, 28, 4, 128, 18944, 152064, 131072),
}


def _step_cost(model: ModelShape, gpu: Gpu, tp: int) -> StepCost:
    weight_bytes = model.params * model.bytes_per_param / tp
    flops_per_token = 2 * model.body_params / tp
    bandwidth = gpu.hbm_bytes_per_s * gpu.bandwidth_efficiency
    compute = gpu.bf16_flops * gpu.flops_efficiency
    dense = []
    for tokens in KNOTS:
        allreduce_s = 0.0
        if tp > 1:  # two ring all-reduces of the activations per layer
            volume = 2 * (tp - 1) / tp * tokens * model.hidden * model.bytes_per_param
            allreduce_s = 2 * model.layers * (10e-6 + volume / gpu.nvlink_bytes_per_s)
        dense.append(
            gpu.step_overhead_s + max(weight_bytes / bandwidth, tokens * flops_per_token / compute) + allreduce_s
        )
    lm_head_s = 2 * model.hidden * model.vocab / tp / compute  # logits of each sampled row
    pair_s = 4 * model.heads * model.head_dim * model.layers / tp / (gpu.bf16_flops * gpu.attention_efficiency)
    context_s = model.kv_bytes_per_token / tp / bandwidth
    return StepCost(KNOTS, tuple(dense), lm_head_s + 5e-6, pair_s, context_s)


def roofline_profile(model_name: str, gpu_name: str, tp_sizes: tuple[int, ...] = (1, 2, 4, 8)) -> Profile:
    """The roofline profile of a model of `MODELS` on a GPU of `GPUS` for each tensor-parallel size."""
    if model_name not in MODELS:
        raise ValueError(f"--model: unknown roofline model {model_name!r}; known: {', '.join(MODELS)}")
    if gpu_name not in GPUS:
        raise ValueError(f"--gpu: unknown GPU {gpu_name!r}; known: {', '.join(GPUS)}")
    model, gpu = MODELS[model_name], GPUS[gpu_name]
    weights = model.params * model.bytes_per_param
    capacity = {}
    for tp in tp_sizes:
        free = tp * gpu.hbm_bytes * gpu.memory_utilization - weights
        if free < model.kv_bytes_per_token * 16:
            raise ValueError(f"{model.name} does not fit {tp} x {gpu.name}")
        capacity[tp] = int(free // model.kv_bytes_per_token)
    facts = ModelFacts(model.name, model.params, model.kv_bytes_per_token, model.max_model_len, model.vocab, 16)
    label = (
        f"ROOFLINE estimate (not measured): {model.name} bf16 on {gpu.name}; "
        f"{gpu.flops_efficiency:.0%} of peak FLOP/s, {gpu.bandwidth_efficiency:.0%} of HBM bandwidth, "
        f"{gpu.step_overhead_s * 1e3:g} ms per step"
    )
    return Profile(
        "roofline",
        label,
        gpu.name,
        facts,
        {tp: _step_cost(model, gpu, tp) for tp in tp_sizes},
        capacity,
        Transfer(latency_s=0.001, bytes_per_s=gpu.nic_bytes_per_s * 0.8),
        Overheads(route_s=0.001, first_token_s=0.001, adopt_s=0.001, token_s=0.001),
        {
            "made_by": "splitserve profile --roofline",
            "model": model_name,
            "gpu": gpu_name,
            "created_unix_s": int(time.time()),
            "gpu_figures": vars(gpu),
        },
    )
