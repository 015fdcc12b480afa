"""Writing a quantized checkpoint folder the way the producers lay it out: the source checkpoint's
files, its decoder layers' linear weights replaced by their quantized parts (`PREFIX.qweight`, ...),
and `quantization_config` added to `config.json`. The embedding, norms and LM head stay as they are,
as GPTQ, AWQ and FP8 releases leave them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engine.quantization.base import CheckpointFormat

QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Latent attention's projections (DeepSeek-V2/V3), which their GPTQ / AWQ releases quantize too.
MLA_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# Mixtral names its experts' projections apart (`...experts.N.w1`); GPTQ / AWQ releases quantize them too.
EXPERT_PROJECTIONS = ("w1", "w2", "w3")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")

# prefix ("model.layers.0.self_attn.q_proj") and its fp32 weight → the stored parts of the layer.
LayerQuantizer = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]


def is_quantized_projection(name: str) -> bool:
    parts = name.split(".")
    expert = len(parts) > 4 and parts[-4] == "experts" and parts[-2] in EXPERT_PROJECTIONS
    projection = parts[-2] in QUANTIZED_PROJECTIONS or parts[-2] in MLA_PROJECTIONS or expert
    return name.startswith("model.layers.") and parts[-1] == "weight" and projection


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(model_dir / file, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle has keys() but no __iter__
                tensors[name] = handle.get_tensor(name)
    return tensors


def write_quantized(
    model_dir: Path,
    out_dir: Path,
    fmt: CheckpointFormat,
    quantize: LayerQuantizer,
    progress: bool = False,
    overrides: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Quantizes every decoder projection of `model_dir` with `quantize` into `out_dir` (one file).
    `overrides` replace source tensors of the same name first (AWQ's rescaled norms and weights)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    source = read_tensors(model_dir)
    for name, tensor in (overrides or {}).items():
        if name in source:
            source[name] = tensor.detach().to(source[name].dtype)
    stored: dict[str, torch.Tensor] = {}
    names = sorted(source)
    for name in tqdm(names, desc=f"quantizing ({fmt.method})", unit="tensor", disable=not progress):
        tensor = source[name]
        if not is_quantized_projection(name):
            stored[name] = tensor.contiguous()
            continue
        prefix = name.removesuffix(".weight")
        for part, value in quantize(prefix, tensor.float()).items():
            stored[f"{prefix}.{part}"] = value.contiguous()
    save_file(stored, out_dir / "model.safetensors", metadata={"format": "pt"})
    for path in model_dir.iterdir():
        if path.is_file() and path.name not in WEIGHT_FILES and not path.name.startswith("model-"):
            shutil.copy2(path, out_dir / path.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = fmt.config()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def write_rtn(model_dir: Path, out_dir: Path, fmt: CheckpointFormat, progress: bool = False) -> Path:
    """Round-to-nearest: every projection rounded on the format's grid, no calibration."""
    return write_quantized(model_dir, out_dir, fmt, lambda prefix, weight: fmt.rtn_parts(weight), progress)
