"""`splitserve quantize MODEL OUT --method gptq|awq|rtn --bits 4|8 --group-size G [--calib FILE]`:
write a quantized copy of a Hugging Face checkpoint in a published format the engine (and vLLM,
transformers) loads: `gptq` and `rtn` in GPTQ's layout, `awq` in AutoAWQ's GEMM layout
(engine/quantization/).

- `rtn`: every decoder projection rounded to nearest on its group's grid; no calibration.
- `gptq`: decoder layers in order; each layer's projections see calibration activations computed by
  the layers before it *already quantized*, and are solved column by column against their Hessian
  (engine/quantization/gptq_solver.py). `--act-order` processes columns by decreasing Hessian
  diagonal (`desc_act`).
- `awq`: per layer, the activation-aware per-channel scales of each group of projections that share an
  input (engine/quantization/awq_search.py) are folded into the RMSNorm gain or previous projection
  that produces the input, then the layer is rounded to nearest; AWQ is 4-bit only.

Calibration text (`--calib FILE`, UTF-8; default: the corpus shipped with the engine) is tokenized with
the checkpoint's tokenizer and cut into `--num-samples` windows of `--seq-len` tokens.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from engine.quantization.awq import AwqFormat
from engine.quantization.awq_search import search_scales
from engine.quantization.gptq import ZERO_OFFSET, GptqFormat
from engine.quantization.gptq_solver import HessianAccumulator, solve
from engine.quantization.writer import QUANTIZED_PROJECTIONS, write_quantized, write_rtn

PROJECTIONS = tuple(
    f"self_attn.{p}" if p.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else f"mlp.{p}"
    for p in QUANTIZED_PROJECTIONS
)
# Projections sharing one input, and what produces that input (where AWQ folds the inverse scales).
AWQ_GROUPS = (
    (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
    (("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
    (("mlp.down_proj",), "mlp.up_proj"),
    (("self_attn.o_proj",), "self_attn.v_proj"),  # only where v's outputs are o's inputs (no GQA)
)


@dataclass(frozen=True)
class QuantizeArgs:
    model: Path
    out: Path
    method: str
    bits: int
    group_size: int
    sym: bool
    act_order: bool
    checkpoint_format: str
    calib: Path | None
    num_samples: int
    seq_len: int

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SystemExit(f"--method: must be one of {sorted(METHODS)}, got {self.method!r}")
        if self.bits not in (4, 8) or (self.method == "awq" and self.bits != 4):
            raise SystemExit(
                f"--bits: {self.method} writes {'4' if self.method == 'awq' else '4 or 8'} bits, got {self.bits}"
            )
        allowed = (64, 128) if self.method == "awq" else (-1, 32, 64, 128)
        if self.group_size not in allowed:
            raise SystemExit(f"--group-size: {self.method} supports {list(allowed)}, got {self.group_size}")
        if self.checkpoint_format not in ZERO_OFFSET:
            raise SystemExit(f"--checkpoint-format: must be one of {list(ZERO_OFFSET)}, got {self.checkpoint_format!r}")
        if self.act_order and self.method != "gptq":
            raise SystemExit("--act-order: only gptq orders columns by activation")
        if self.num_samples < 1 or self.seq_len < 2:
            raise SystemExit("--num-samples must be >= 1 and --seq-len >= 2")


def _gptq_format(args: QuantizeArgs, act_order: bool) -> GptqFormat:
    return GptqFormat(
        bits=args.bits, group_size=args.group_size, sym=args.sym, desc_act=act_order, version=args.checkpoint_format
    )


def calibration_tokens(args: QuantizeArgs) -> torch.Tensor:
    """[num_samples, seq_len] token ids: windows spread evenly over the calibration text."""
    from engine.demo_model import corpus_text

    text = args.calib.read_text(encoding="utf-8") if args.calib else corpus_text()
    ids = AutoTokenizer.from_pretrained(args.model)(text, verbose=False)["input_ids"]
    if len(ids) < args.seq_len:
        raise SystemExit(f"--calib: {len(ids)} tokens of text, fewer than --seq-len {args.seq_len}")
    stride = max(1, (len(ids) - args.seq_len) // max(1, args.num_samples - 1))
    starts = [min(i * stride, len(ids) - args.seq_len) for i in range(args.num_samples)]
    return torch.tensor([ids[s : s + args.seq_len] for s in starts])


class _Stop(Exception):
    """Raised by a hook once the layer of interest has run: the rest of the model is not needed."""


def layer_inputs(
    model: PreTrainedModel, index: int, names: tuple[str, ...], tokens: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The inputs [tokens, in] of decoder layer `index`'s modules `names` on the calibration tokens."""
    layer = model.model.layers[index]
    captured: dict[str, torch.Tensor] = {}
    hooks = [
        layer.get_submodule(name).register_forward_pre_hook(
            lambda module, inputs, name=name: captured.__setitem__(name, inputs[0].reshape(-1, inputs[0].shape[-1]))
        )
        for name in names
    ]

    def stop(module, inputs, output):
        raise _Stop

    hooks.append(layer.register_forward_hook(stop))
    try:
        with torch.no_grad():
            model(tokens)
    except _Stop:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def _load(args: QuantizeArgs, projections: tuple[str, ...]) -> PreTrainedModel:
    """The checkpoint in fp32, refused in one line where a calibrated method cannot reach its projections:
    calibration captures each dense projection's inputs, and mixture-of-experts layers (routed experts) and
    latent attention have none of those modules to hook (`--method rtn` rounds every layer kind)."""
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    for index, layer in enumerate(model.model.layers):
        missing = [name for name in projections if not _has_submodule(layer, name)]
        if missing:
            raise SystemExit(
                f"--method: {args.method} calibrates dense attention and MLP projections only; decoder layer "
                f"{index} has no {', '.join(missing)} (a mixture-of-experts or latent-attention model): "
                "use --method rtn"
            )
    return model


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def quantize_rtn(args: QuantizeArgs) -> Path:
    return write_rtn(args.model, args.out, _gptq_format(args, act_order=False), progress=True)


def quantize_gptq(args: QuantizeArgs) -> Path:
    fmt = _gptq_format(args, args.act_order)
    model, tokens = _load(args, PROJECTIONS), calibration_tokens(args)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for index in tqdm(range(len(model.model.layers)), desc="gptq", unit="layer"):
        inputs = layer_inputs(model, index, PROJECTIONS, tokens)
        layer = model.model.layers[index]
        for name in PROJECTIONS:
            linear: nn.Linear = layer.get_submodule(name)
            hessian = HessianAccumulator(linear.in_features)
            hessian.add(inputs[name])
            result = solve(
                linear.weight.data,
                hessian.hessian,
                args.bits,
                args.group_size,
                args.sym,
                args.act_order,
                min_zero=ZERO_OFFSET[args.checkpoint_format],
            )
            parts[f"model.layers.{index}.{name}"] = fmt.pack_layer(
                result.values, result.zeros, result.scales, result.g_idx
            )
            g_idx = result.g_idx.long()
            with torch.no_grad():  # the layers after this one calibrate on its quantized outputs
                linear.weight.copy_((result.values - result.zeros[g_idx].t()).float() * result.scales[g_idx].t())
    return write_quantized(args.model, args.out, fmt, lambda prefix, weight: parts[prefix])


def quantize_awq(args: QuantizeArgs) -> Path:
    fmt = AwqFormat(group_size=args.group_size)
    awq_modules = tuple(name for names, producer in AWQ_GROUPS for name in (*names, producer))
    model, tokens = _load(args, awq_modules), calibration_tokens(args)
    for index in tqdm(range(len(model.model.layers)), desc="awq", unit="layer"):
        layer = model.model.layers[index]
        inputs = layer_inputs(model, index, tuple(group[0] for group, _ in AWQ_GROUPS), tokens)
        for names, producer_name in AWQ_GROUPS:
            linears = [layer.get_submodule(name) for name in names]
            producer = layer.get_submodule(producer_name)
            if producer.weight.shape[0] != linears[0].in_features:
                continue  # grouped-query attention: v's outputs are not o's inputs one to one
            scales = search_scales(inputs[names[0]], [lin.weight.data for lin in linears], 4, args.group_size)
            with torch.no_grad():
                producer.weight.div_(scales if producer.weight.dim() == 1 else scales[:, None])
                if getattr(producer, "bias", None) is not None:
                    producer.bias.div_(scales)
                for linear in linears:
                    linear.weight.mul_(scales[None, :])
    rescaled = dict(model.state_dict())
    return write_quantized(args.model, args.out, fmt, lambda prefix, weight: fmt.rtn_parts(weight), overrides=rescaled)


METHODS: dict[str, Callable[[QuantizeArgs], Path]] = {"rtn": quantize_rtn, "gptq": quantize_gptq, "awq": quantize_awq}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="splitserve quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="Hugging Face checkpoint directory")
    parser.add_argument("out", type=Path, help="where to write the quantized checkpoint")
    parser.add_argument("--method", required=True, help=f"one of {sorted(METHODS)}")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=128, help="input features per scale; -1: one group")
    parser.add_argument("--asym", action="store_true", help="gptq / rtn: a zero point per group (default symmetric)")
    parser.add_argument("--act-order", action="store_true", help="gptq: quantize columns by decreasing activation")
    parser.add_argument("--checkpoint-format", default="gptq", help="gptq (v1, what vLLM reads) or gptq_v2")
    parser.add_argument("--calib", type=Path, help="calibration text (UTF-8); default: the shipped corpus")
    parser.add_argument("--num-samples", type=int, default=32, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per calibration window")
    ns = parser.parse_args(argv)
    args = QuantizeArgs(
        model=ns.model,
        out=ns.out,
        method=ns.method,
        bits=ns.bits,
        group_size=ns.group_size,
        sym=not ns.asym,
        act_order=ns.act_order,
        checkpoint_format=ns.checkpoint_format,
        calib=ns.calib,
        num_samples=ns.num_samples,
        seq_len=ns.seq_len,
    )
    print(METHODS[args.method](args))
