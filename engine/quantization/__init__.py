"""Pre-quantized checkpoints: the formats their producers publish, read back into full-precision weights.

A checkpoint whose `config.json` has a `quantization_config` names its format in `quant_method`;
`CHECKPOINT_FORMATS` is the registry of the ones splitserve reads, one module each (`gptq.py`,
`awq.py`, `fp8.py`). Anything else fails naming the method and listing these. `WeightAssembler`
(assembly.py) turns a quantized layer's tensors into the `weight` the model loads.
"""

from __future__ import annotations

from typing import Any

from engine.errors import UnsupportedModelError
from engine.quantization.awq import AwqFormat
from engine.quantization.base import CheckpointFormat
from engine.quantization.fp8 import Fp8Format
from engine.quantization.gptq import GptqFormat

CHECKPOINT_FORMATS: dict[str, type[CheckpointFormat]] = {
    GptqFormat.method: GptqFormat,
    AwqFormat.method: AwqFormat,
    Fp8Format.method: Fp8Format,
}


def checkpoint_format(raw_config: dict[str, Any]) -> CheckpointFormat | None:
    """The format a checkpoint's `config.json` declares, or None for an unquantized checkpoint."""
    quant = raw_config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise UnsupportedModelError(f"quantization_config must be an object, got {type(quant).__name__}")
    method = quant.get("quant_method")
    if method not in CHECKPOINT_FORMATS:
        raise UnsupportedModelError(
            f"quantization_config.quant_method={method!r} is not supported; supported: {sorted(CHECKPOINT_FORMATS)}"
        )
    return CHECKPOINT_FORMATS[method].from_config(quant)


__all__ = ["CHECKPOINT_FORMATS", "CheckpointFormat", "checkpoint_format"]
