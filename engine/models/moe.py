"""Mixture-of-experts feed-forward blocks: a router, the fused routed experts, an optional shared expert.

Each family routes its own way; `ROUTERS` names each computation, written as the HF model computes it
(scores in fp32):
- `softmax`: softmax over the router logits, top-k, renormalized when `norm_topk_prob` (Mixtral always,
  Qwen2/Qwen3-MoE by config, DeepSeek-V2's `greedy` never), times `routed_scaling_factor`.
- `softmax_group_limited`: DeepSeek-V2's `group_limited_greedy`: experts in `n_group` groups; only the
  `topk_group` groups with the highest single score compete, then top-k of the softmax scores.
- `sigmoid_grouped`: DeepSeek-V3's `noaux_tc`: sigmoid scores plus a learned correction bias choose
  (groups ranked by the sum of their top two biased scores, then top-k within the kept groups); the
  unbiased scores of the chosen experts are the weights, renormalized by config and scaled.

Module names follow HF's (`gate`, `experts`, `shared_expert` + `shared_expert_gate` for Qwen2-MoE) so
checkpoint tensors map by name; Mixtral's `block_sparse_moe` and DeepSeek's `shared_experts` are
renamed at load (engine/model_loader.py's architecture traits).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig, MoEConfig
from engine.layers.fused_moe import FusedMoE
from engine.layers.linear import ReplicatedLinear
from engine.layers.mlp import MLP
from engine.layers.quantization import QuantizationSpec
from engine.parallel import TensorParallelGroup

Routing = tuple[torch.Tensor, torch.Tensor]  # (weights fp32 [tokens, top_k], expert ids [tokens, top_k])


def _finish(scores: torch.Tensor, ids: torch.Tensor, cfg: MoEConfig) -> Routing:
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


def _group_mask(group_scores: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """[tokens, num_experts] bool: the experts of each token's `topk_groups` best groups."""
    kept = torch.topk(group_scores, k=cfg.topk_groups, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    return mask.repeat_interleave(cfg.num_experts // cfg.num_groups, dim=1)


def route_softmax(logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None) -> Routing:
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return _finish(scores, torch.topk(scores, cfg.top_k, dim=-1)[1], cfg)


def route_softmax_group_limited(logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None) -> Routing:
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    group_scores = scores.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups).amax(dim=-1)
    masked = scores.masked_fill(~_group_mask(group_scores, cfg), 0.0)
    return _finish(scores, torch.topk(masked, cfg.top_k, dim=-1, sorted=False)[1], cfg)


def route_sigmoid_grouped(logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None) -> Routing:
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    per_group = choice.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups)
    group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(dim=-1)
    choice = choice.masked_fill(~_group_mask(group_scores, cfg), float("-inf"))
    ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


ROUTERS: dict[str, Callable[[torch.Tensor, MoEConfig, torch.Tensor | None], Routing]] = {
    "softmax": route_softmax,
    "softmax_group_limited": route_softmax_group_limited,
    "sigmoid_grouped": route_sigmoid_grouped,
}


class Router(nn.Module):
    """`gate.weight` [experts, hidden] (replicated, applied in fp32) and, for `sigmoid_grouped`, the
    correction bias `gate.e_score_correction_bias` that only steers the choice."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        if cfg.routing not in ROUTERS:
            raise ValueError(f"unknown MoE routing {cfg.routing!r}; known: {sorted(ROUTERS)}")
        self.cfg, self.route = cfg, ROUTERS[cfg.routing]
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32), requires_grad=False)
            if cfg.routing == "sigmoid_grouped"
            else None
        )

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x.float(), self.weight.float())
        return self.route(logits, self.cfg, self.e_score_correction_bias)


class SparseMoeBlock(nn.Module):
    """Routed experts plus, when the config has one, a shared expert (gated by sigmoid for Qwen2-MoE)."""

    def __init__(
        self,
        cfg: ModelConfig,
        moe: MoEConfig,
        tp: TensorParallelGroup,
        quantization: QuantizationSpec,
        expert_parallel: bool,
        layer_index: int = 0,
    ):
        super().__init__()
        dtype = cfg.torch_dtype
        self.layer_index = layer_index
        self.gate = Router(moe, cfg.hidden_size, dtype)
        # Tokens routed to each expert since load (a token counts once per expert it chose): the load
        # balance a worker exports (`expert_token_counts`). Counted where it is computed, on the model's
        # device, so a step never waits on it; read only when a worker reports.
        self.expert_tokens: torch.Tensor
        self.register_buffer("expert_tokens", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False)
        self.experts = FusedMoE(
            moe.num_experts, cfg.hidden_size, moe.intermediate_size, dtype, tp, expert_parallel, quantization
        )
        self.shared_expert = (
            MLP(cfg.hidden_size, moe.shared_intermediate_size, dtype, tp, quantization)
            if moe.shared_intermediate_size
            else None
        )
        self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, dtype) if moe.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        chosen = expert_ids.view(-1)  # scatter, not bincount: no size to read back, so a step never syncs on it
        self.expert_tokens.scatter_add_(0, chosen, torch.ones_like(chosen))
        out = self.experts(x, expert_ids, weights)
        if self.shared_expert is None:
            return out
        shared_out = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared_out = torch.sigmoid(self.shared_expert_gate(x)) * shared_out
        return out + shared_out


def feed_forward(
    cfg: ModelConfig, layer_index: int, tp: TensorParallelGroup, quantization: QuantizationSpec, expert_parallel: bool
) -> nn.Module:
    """Layer `layer_index`'s feed-forward block: dense for dense models and the dense layers of MoE ones."""
    moe = cfg.moe
    if moe is None or layer_index in moe.dense_layers:
        return MLP(cfg.hidden_size, cfg.intermediate_size, cfg.torch_dtype, tp, quantization)
    return SparseMoeBlock(cfg, moe, tp, quantization, expert_parallel, layer_index)


def expert_token_counts(model: nn.Module) -> dict[int, list[int]]:
    """Layer index → tokens routed to each of its experts since load, for every MoE layer of `model`
    (empty for a dense model). Every rank of a TP group routes every token, so any rank's counts are
    the instance's."""
    blocks = [module for module in model.modules() if isinstance(module, SparseMoeBlock)]
    if not blocks:
        return {}
    counts = torch.stack([block.expert_tokens for block in blocks]).tolist()  # one device read for all
    return {block.layer_index: row for block, row in zip(blocks, counts, strict=True)}
