"""A mixture-of-experts layer's routed experts, fused: every expert's gate/up projection in one
`[experts, 2 x intermediate, hidden]` tensor and its down projection in one `[experts, hidden,
intermediate]` tensor, filled at load from the checkpoint's per-expert tensors (`expert_target`).

Sharding over a tensor-parallel group (the layer owns it, like the linear layers):
- expert parallel (`expert_parallel=True`): each rank holds `num_experts / tp` whole experts. The
  group's ranks all hold every token of the step (attention's output is all-reduced), so dispatch
  needs no communication: each rank runs its own experts on the tokens routed to them, and the
  combine is one all-reduce of the partial sums, the same collective a row-parallel layer ends with.
- tensor parallel (`expert_parallel=False`): every rank holds every expert, with its intermediate
  features split as in a column-then-row-parallel MLP; also combined by one all-reduce.

Tokens are grouped by expert and each expert's rows run as one matmul pair, accumulated into the
output in ascending expert order, the order HF's reference loop adds them in. How a weight is stored
and multiplied (fp, int8 per output channel, int8 per group of `quantization_group_size` inputs, int4
per group: a GPTQ / AWQ checkpoint's own integers) is an `ExpertMethod` from `EXPERT_METHODS`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import UnsupportedModelError
from engine.layers.dense_matmul import dense_linear
from engine.layers.int4_matmul import BLOCK, int4_matmul, pack_int4
from engine.layers.int8_group_matmul import int8_group_matmul, quantize_groupwise
from engine.layers.int8_matmul import int8_matmul
from engine.layers.quantization import QuantizationSpec, as_weight_quantization, int4_form, quantize_per_channel
from engine.parallel import SINGLE_RANK, TensorParallelGroup
from engine.quantization.base import GroupQuantized

# Checkpoint names of one expert's projections (HF Mixtral: w1/w3/w2; Qwen/DeepSeek: gate/up/down)
# → (fused parameter, which half of gate_up or None for down).
_PROJECTIONS = {
    "w1": ("w13_weight", 0),
    "gate_proj": ("w13_weight", 0),
    "w3": ("w13_weight", 1),
    "up_proj": ("w13_weight", 1),
    "w2": ("w2_weight", None),
    "down_proj": ("w2_weight", None),
}
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def expert_target(name: str) -> tuple[str, tuple[int, int | None]] | None:
    """(fused parameter name, (expert, half)) for a per-expert checkpoint tensor; None for others."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match["proj"] not in _PROJECTIONS:
        return None
    param, half = _PROJECTIONS[match["proj"]]
    return f"{match['prefix']}.{param}", (int(match["expert"]), half)


class ExpertMethod:
    """Creates a fused experts layer's weights and multiplies rows by one expert's weight."""

    def create(self, layer: FusedMoE, name: str, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
        raise NotImplementedError

    def apply(self, layer: FusedMoE, name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class UnquantizedExperts(ExpertMethod):
    def create(self, layer, name, shape, dtype):
        weight = _param(*shape, dtype=dtype)
        weight.weight_loader = layer.weight_loader  # type: ignore[attr-defined]  # rides on the Parameter
        setattr(layer, name, weight)

    def apply(self, layer, name, expert, x):
        return dense_linear(x, getattr(layer, name)[expert])


class Int8Experts(ExpertMethod):
    """int8 weights with one fp32 scale per output channel of each expert, taken over the full
    checkpoint row before the layer keeps its shard (as engine/layers/quantization.py's int8)."""

    def create(self, layer, name, shape, dtype):
        weight = _param(*shape, dtype=torch.int8)
        scale = _param(*shape[:2], dtype=torch.float32)
        weight.load_dtype = torch.float32  # type: ignore[attr-defined]  # what the loader is handed
        weight.weight_loader = lambda param, loaded, shard_id: self._load(layer, name, loaded, shard_id)  # type: ignore[attr-defined]
        scale.filled_by = name  # type: ignore[attr-defined]  # not a checkpoint tensor: the weight's loader writes it
        setattr(layer, name, weight)
        setattr(layer, f"{name}_scale", scale)

    @staticmethod
    def _load(layer: FusedMoE, name: str, loaded: torch.Tensor, shard_id) -> None:
        values, scale = quantize_per_channel(loaded)
        layer.weight_loader(getattr(layer, name), values, shard_id)
        layer.weight_loader(getattr(layer, f"{name}_scale"), scale[:, None], shard_id, scale_of=name)

    def apply(self, layer, name, expert, x):
        return int8_matmul(x, getattr(layer, name)[expert], getattr(layer, f"{name}_scale")[expert])


class Int8GroupExperts(ExpertMethod):
    """int8 weights with one fp32 scale per group of `group_size` consecutive inputs of each expert
    (`{name}_scale` [experts, out, in / group_size]), taken over the full checkpoint row before the layer
    keeps its shard, as engine/layers/quantization.py's Int8GroupWise: a TP-sharded down projection's
    rank holds whole groups of its intermediate features, so its slice is the single rank's slice."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create(self, layer, name, shape, dtype):
        experts, out_features, in_features = shape
        if in_features % self.group_size:
            raise UnsupportedModelError(
                f"quantization_group_size: {self.group_size} does not divide the {in_features} input features of "
                f"the experts' {name} (per tensor-parallel rank); choose a divisor of them"
            )
        weight = _param(*shape, dtype=torch.int8)
        scale = _param(experts, out_features, in_features // self.group_size, dtype=torch.float32)
        weight.load_dtype = torch.float32  # type: ignore[attr-defined]  # what the loader is handed
        weight.weight_loader = lambda param, loaded, shard_id: self._load(layer, name, loaded, shard_id)  # type: ignore[attr-defined]
        scale.filled_by = name  # type: ignore[attr-defined]  # not a checkpoint tensor: the weight's loader writes it
        setattr(layer, name, weight)
        setattr(layer, f"{name}_scale", scale)

    def _load(self, layer: FusedMoE, name: str, loaded: torch.Tensor, shard_id) -> None:
        values, scale = quantize_groupwise(loaded, self.group_size)
        layer.weight_loader(getattr(layer, name), values, shard_id)
        layer.weight_loader(getattr(layer, f"{name}_scale"), scale, shard_id)  # groups shard like the columns

    def apply(self, layer, name, expert, x):
        return int8_group_matmul(x, getattr(layer, name)[expert], getattr(layer, f"{name}_scale")[expert])


class Int4Experts(ExpertMethod):
    """4-bit weights two a byte in int4_matmul's layout (`{name}` uint8 [experts, out, in / 2]) with an
    fp32 scale and zero point per group of inputs (`{name}_scale`, `{name}_zero` [experts, out, groups],
    sized by the first expert loaded). A GPTQ / AWQ expert keeps its checkpoint's integers, scales and
    group size exactly; an unquantized one is rounded at load like the linear layers' int4
    (engine/layers/quantization.py `int4_form`). An act-order expert's inputs are sorted by group at load
    and its rows' features permuted to match (`{name}_input_order` [experts, in], identity for the
    experts without act-order); gate and up read one input, so they must share one order. TP-sharded
    experts split a down projection's inputs, which must then hold whole groups; an act-order down
    projection's rank holds the groups its inputs touch instead, every expert of the layer as runs of
    BLOCK inputs padded with reads of a zero feature appended to the rows (`padded`;
    GroupQuantized.shard_in_group_order), as wide as its widest expert."""

    def __init__(self, group_size: int | None):
        self.group_size = group_size
        self.orders: dict[tuple[str, int], torch.Tensor | None] = {}  # (name, local expert) → its input order
        self.inputs: dict[str, int] = {}  # name → input features per rank
        self.padded: set[str] = set()  # names held as padded runs (act-order inputs split over the ranks)
        self.in_order: set[str] = set()  # names with an expert loaded in input order

    def create(self, layer, name, shape, dtype):
        experts, out_features, in_features = shape
        self.inputs[name] = in_features
        if in_features % BLOCK:
            raise UnsupportedModelError(
                f"int4 expert weights need a multiple of {BLOCK} input features, got {in_features} for the experts' "
                f"{name} (per tensor-parallel rank)"
            )
        weight = _param(experts, out_features, in_features // 2, dtype=torch.uint8)
        weight.load_dtype = torch.float32  # type: ignore[attr-defined]  # what the loader is handed
        weight.weight_loader = lambda param, loaded, shard_id: self._load(layer, name, loaded, shard_id)  # type: ignore[attr-defined]
        setattr(layer, name, weight)
        for part in ("scale", "zero"):
            groups = _param(experts, out_features, 0, dtype=torch.float32)
            groups.filled_by = name  # type: ignore[attr-defined]  # not a checkpoint tensor: the weight's loader writes it
            setattr(layer, f"{name}_{part}", groups)
        layer.register_buffer(f"{name}_input_order", None, persistent=False)

    def _load(self, layer: FusedMoE, name: str, loaded: torch.Tensor, shard_id: tuple[int, int | None]) -> None:
        local = shard_id[0] - layer.first_expert
        if not 0 <= local < layer.num_local_experts:
            return  # another rank's expert
        full = int4_form(loaded, self.group_size)
        form, order = full.in_group_order()
        weight, in_local = getattr(layer, name), self.inputs[name]
        if in_local != form.values.shape[1] and (order is not None or name in self.padded):
            self._load_padded(layer, name, full, local, shard_id)
            return
        self.in_order.add(name)
        if in_local % form.group_size:
            raise UnsupportedModelError(
                f"layer {form.name}: a tensor-parallel shard of {in_local} input features would split its groups of "
                f"{form.group_size}"
            )
        self._take_order(layer, name, form.name, local, order)
        for part in ("scale", "zero"):
            groups = getattr(layer, f"{name}_{part}")
            if groups.shape[2] == 0:
                groups.data = torch.zeros(*groups.shape[:2], in_local // form.group_size)
            elif groups.shape[2] != in_local // form.group_size:
                raise UnsupportedModelError(
                    f"layer {form.name}: groups of {form.group_size} inputs, unlike the other experts of its layer"
                )
        layer.weight_loader(weight, pack_int4(form.values), shard_id)
        layer.weight_loader(getattr(layer, f"{name}_scale"), form.scales.t().contiguous(), shard_id)
        layer.weight_loader(getattr(layer, f"{name}_zero"), form.zeros.t().contiguous(), shard_id)

    def _load_padded(
        self, layer: FusedMoE, name: str, full: GroupQuantized, local: int, shard_id: tuple[int, int | None]
    ) -> None:
        """One expert's act-order down projection under TP-sharded experts (class docstring)."""
        if name in self.in_order:
            raise UnsupportedModelError(
                f"layer {full.name}: act-order experts (g_idx) next to experts in input order under TP-sharded "
                "experts; serve them with expert_parallel: true"
            )
        in_local, weight = self.inputs[name], getattr(layer, name)
        if name not in self.padded:  # the first act-order expert: widths grow with the widest expert
            self.padded.add(name)
            weight.data = weight.data.new_zeros(*weight.shape[:2], 0)
            for part in ("scale", "zero"):
                groups = getattr(layer, f"{name}_{part}")
                groups.data = groups.data.new_zeros(*groups.shape[:2], 0)
            setattr(layer, f"{name}_input_order", torch.zeros(layer.num_local_experts, 0, dtype=torch.long))
        columns = _param(layer.num_local_experts, 1, in_local, dtype=torch.long)
        layer.weight_loader(columns, torch.arange(full.values.shape[1])[None], shard_id)  # this rank's inputs
        g_idx = full.g_idx if full.g_idx is not None else torch.arange(full.values.shape[1]) // full.group_size
        shard, order = full._replace(g_idx=g_idx).shard_in_group_order(columns[local, 0], BLOCK)
        self._widen(layer, name, order.numel(), pad_index=in_local)
        width = order.numel()
        weight.data[local, :, : width // 2] = pack_int4(shard.values)
        getattr(layer, f"{name}_scale").data[local, :, : width // BLOCK] = shard.scales.t()
        getattr(layer, f"{name}_zero").data[local, :, : width // BLOCK] = shard.zeros.t()
        getattr(layer, f"{name}_input_order")[local, :width] = order

    @staticmethod
    def _widen(layer: FusedMoE, name: str, width: int, pad_index: int) -> None:
        """Every expert's padded runs to `width` inputs: the new slots have zero scales and read the zero
        feature, so they add nothing."""
        weight = getattr(layer, name)
        extra = width - weight.shape[2] * 2
        if extra <= 0:
            return
        weight.data = torch.cat([weight.data, weight.data.new_zeros(*weight.shape[:2], extra // 2)], dim=2)
        for part in ("scale", "zero"):
            groups = getattr(layer, f"{name}_{part}")
            groups.data = torch.cat([groups.data, groups.data.new_zeros(*groups.shape[:2], extra // BLOCK)], dim=2)
        orders = getattr(layer, f"{name}_input_order")
        setattr(
            layer, f"{name}_input_order", torch.cat([orders, orders.new_full((orders.shape[0], extra), pad_index)], 1)
        )

    def _take_order(self, layer: FusedMoE, name: str, layer_name: str, local: int, order: torch.Tensor | None) -> None:
        if (name, local) in self.orders:  # the other half of gate/up
            kept = self.orders[(name, local)]
            if not (order is kept is None or (order is not None and kept is not None and torch.equal(order, kept))):
                raise UnsupportedModelError(
                    f"layer {layer_name}: its inputs are grouped in another order (g_idx) than the expert's other "
                    "projection of the same input; serve it with quantization none"
                )
            return
        self.orders[(name, local)] = order
        if order is None:
            return
        orders = getattr(layer, f"{name}_input_order")
        if orders is None:
            orders = torch.arange(order.numel()).repeat(layer.num_local_experts, 1)
            setattr(layer, f"{name}_input_order", orders)
        orders[local] = order

    def apply(self, layer, name, expert, x):
        orders = getattr(layer, f"{name}_input_order")
        if orders is not None:
            x = F.pad(x, (0, 1))[..., orders[expert]] if name in self.padded else x.index_select(-1, orders[expert])
        weight = getattr(layer, name)
        return int4_matmul(
            x, weight[expert], getattr(layer, f"{name}_scale")[expert], getattr(layer, f"{name}_zero")[expert]
        )


def _int8_experts(group_size: int | None) -> ExpertMethod:
    return Int8Experts() if group_size is None else Int8GroupExperts(group_size)


# method name → the ExpertMethod for a group size (None: the method's default grouping).
# An FP8 checkpoint's experts are dequantized at load on every device (its linear layers stay e4m3 on CUDA).
EXPERT_METHODS: dict[str, Callable[[int | None], ExpertMethod]] = {
    "none": lambda group_size: UnquantizedExperts(),
    "int8": _int8_experts,
    "int4": Int4Experts,
    "fp8": lambda group_size: UnquantizedExperts(),
}


def expert_method(quantization: QuantizationSpec) -> ExpertMethod:
    spec = as_weight_quantization(quantization)
    if spec.method not in EXPERT_METHODS:
        raise ValueError(f"unknown quantization {spec.method!r} for experts; known: {sorted(EXPERT_METHODS)}")
    return EXPERT_METHODS[spec.method](spec.group_size)


class FusedMoE(nn.Module):
    """The routed experts of one layer: `forward(x, expert_ids, weights)` → Σ_k weight_k · expert_k(x),
    summed over the group (see the module docstring for the two shardings)."""

    w13_weight: nn.Parameter
    w2_weight: nn.Parameter

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        tp: TensorParallelGroup = SINGLE_RANK,
        expert_parallel: bool = True,
        quantization: QuantizationSpec = "none",
    ):
        super().__init__()
        self.tp, self.num_experts = tp, num_experts
        self.expert_parallel = expert_parallel and tp.size > 1
        if self.expert_parallel:
            self.num_local_experts = tp.shard(num_experts, "num_experts (expert parallel)")
            self.intermediate_local = intermediate_size
        else:
            self.num_local_experts = num_experts
            self.intermediate_local = tp.shard(intermediate_size, "moe_intermediate_size")
        self.first_expert = tp.rank * self.num_local_experts if self.expert_parallel else 0
        self.method = expert_method(quantization)
        local, inter = self.num_local_experts, self.intermediate_local
        self.method.create(self, "w13_weight", (local, 2 * inter, hidden_size), dtype)
        self.method.create(self, "w2_weight", (local, hidden_size, inter), dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int | None], scale_of: str | None = None
    ) -> None:
        """One expert's checkpoint tensor (or, for int8 / int4, its scales: `[out, 1]` per channel with
        `scale_of`, `[out, groups]` group-wise; int4's packed bytes `[out, in / 2]`): kept only by the rank
        that holds the expert, narrowed to this rank's intermediate slice under TP-sharded experts."""
        expert, half = shard_id
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        inter, rank = self.intermediate_local, 0 if self.expert_parallel else self.tp.rank
        target = param.data[local]
        if half is not None:  # gate (0) or up (1): rows [half * inter, (half + 1) * inter) of w13
            target.narrow(0, half * inter, inter).copy_(loaded.narrow(0, rank * inter, inter).view_as(target[:inter]))
        elif scale_of is not None:  # down's scales: per output channel, every rank holds them all
            target.copy_(loaded.view_as(target))
        else:  # down: columns are the intermediate features (or whole groups of them: their scales)
            columns = target.shape[1]
            target.copy_(loaded.narrow(1, rank * columns, columns))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden]; expert_ids, weights [tokens, top_k] (weights fp32) → [tokens, hidden]."""
        out = torch.zeros_like(x)
        local_ids = expert_ids - self.first_expert
        mine = (local_ids >= 0) & (local_ids < self.num_local_experts)
        flat = torch.where(mine, local_ids, self.num_local_experts).view(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_local_experts + 1).tolist()
        top_k, start = expert_ids.shape[1], 0
        for expert, count in enumerate(counts[: self.num_local_experts]):
            if count:
                picks = order[start : start + count]
                tokens = picks // top_k
                gate, up = self.method.apply(self, "w13_weight", expert, x[tokens]).chunk(2, dim=-1)
                y = self.method.apply(self, "w2_weight", expert, F.silu(gate) * up)
                y = y * weights.view(-1)[picks, None]
                out.index_add_(0, tokens, y.to(out.dtype))
            start += count
        return self.tp.all_reduce(out)
