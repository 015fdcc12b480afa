"""FP8 checkpoint layers kept in e4m3 (engine/layers/quantization.py `Fp8Weights`): which devices keep
them, how fused and tensor-parallel layers slice weights and scales, which layers stay in the model
dtype, and which backend `fp8_matmul` takes where. The layers run the `dequantize` backend here; the
kernel's own checks are tests/engine/test_triton_fp8_linear.py."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from engine.layers.fp8_matmul import TRITON_MAX_ROWS, select_backend
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.quantization import Fp8Weights, Unquantized, WeightQuantization, linear_method, weight_quantization
from engine.parallel import TensorParallelGroup
from engine.quantization import checkpoint_format
from tests.engine.interpreted import ROOT

BLOCK = {"quant_method": "fp8", "weight_block_size": [16, 24]}
PER_TENSOR = {"quant_method": "fp8"}


@pytest.mark.parametrize(
    "method, checkpoint_method, device, expected",
    [
        ("none", "fp8", "cuda", WeightQuantization("fp8")),
        ("none", "fp8", "cpu", WeightQuantization("none")),  # dequantized at load
        ("int8", "fp8", "cuda", WeightQuantization("int8")),  # an asked-for quantization wins
        ("int4", "fp8", "cuda", WeightQuantization("int4", 64)),
        ("none", "gptq", "cuda", WeightQuantization("none")),
        ("none", None, "cuda", WeightQuantization("none")),
    ],
)
def test_an_fp8_checkpoint_keeps_its_weights_on_cuda_only(method, checkpoint_method, device, expected):
    group_size = 64 if method == "int4" else None
    assert weight_quantization(method, group_size, checkpoint_method, device) == expected
    assert isinstance(linear_method(WeightQuantization("fp8")), Fp8Weights)


@pytest.mark.parametrize(
    "device, dtype, rows, backend",
    [
        ("cuda", torch.bfloat16, 1, "triton"),
        ("cuda", torch.float16, TRITON_MAX_ROWS, "triton"),
        ("cuda", torch.bfloat16, TRITON_MAX_ROWS + 1, "dequantize"),
        ("cuda", torch.float32, 1, "dequantize"),
        ("cpu", torch.float32, 1, "dequantize"),
    ],
)
def test_backend_selection_by_device_dtype_and_rows(device, dtype, rows, backend):
    fake = SimpleNamespace(device=torch.device(device), is_cuda=device == "cuda", dtype=dtype, shape=(rows, 64))
    assert select_backend(fake).name == backend


def _loaded(config: dict, out_features: int, in_features: int, seed: int, name: str = "layer") -> torch.Tensor:
    """What the loader hands a layer for one checkpoint tensor: the dequantized fp32 weight carrying its
    e4m3 form (engine/quantization/assembly.py)."""
    fmt = checkpoint_format({"quantization_config": config})
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    parts = fmt.rtn_parts(weight)
    dequantized = fmt.dequantize(name, parts)
    dequantized.float8_form = fmt.float8_form(name, parts)  # type: ignore[attr-defined]
    return dequantized


def _tp(rank: int, size: int) -> TensorParallelGroup:
    return TensorParallelGroup(rank=rank, size=size, process_group=object() if size > 1 else None)


def _check_output(layer, expected_weight: torch.Tensor) -> None:
    x = torch.randn(5, expected_weight.shape[1], generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(layer.method.apply(layer, x), x @ expected_weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [BLOCK, PER_TENSOR], ids=["blocks", "per-tensor"])
@pytest.mark.parametrize("rank", [0, 1])
def test_fused_column_parallel_parts_keep_e4m3_and_slice_their_scales_by_row(config, rank):
    """gate / up of 40 rows each (blocks of 16: the fused layer's blocks no longer line up with the
    checkpoint's), half of each on a rank."""
    layer = MergedColumnParallelLinear(72, [40, 40], False, torch.float32, _tp(rank, 2), Fp8Weights())
    parts = [_loaded(config, 40, 72, seed) for seed in (1, 2)]
    for shard_id, part in enumerate(parts):
        layer.weight.weight_loader(layer.weight, part, shard_id)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.shape == (40, 72)
    block_in = 24 if config is BLOCK else 72
    assert layer.weight_block_in == block_in and layer.weight_scale.shape == (40, 72 // block_in)
    _check_output(layer, torch.cat([part[rank * 20 : (rank + 1) * 20] for part in parts]))


def test_qkv_parts_keep_e4m3_with_partial_blocks():
    layer = QKVParallelLinear(40, 8, 4, 2, False, torch.float32, method=Fp8Weights())
    parts = {"q": _loaded(BLOCK, 32, 40, 4), "k": _loaded(BLOCK, 16, 40, 5), "v": _loaded(BLOCK, 16, 40, 6)}
    for shard_id, part in parts.items():
        layer.weight.weight_loader(layer.weight, part, shard_id)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (64, 2)  # 40 = 24 + 16
    _check_output(layer, torch.cat(list(parts.values())))


@pytest.mark.parametrize("rank", [0, 1])
def test_row_parallel_shards_of_whole_blocks_keep_e4m3(rank):
    loaded = _loaded(BLOCK, 24, 96, 7)  # 48 inputs a rank: two blocks of 24
    layer = RowParallelLinear(96, 24, False, torch.float32, _tp(rank, 2), Fp8Weights())
    layer.weight.weight_loader(layer.weight, loaded)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (24, 2)
    _check_output(layer, loaded[:, rank * 48 : (rank + 1) * 48])


def test_per_tensor_scales_serve_every_row_parallel_shard():
    loaded = _loaded(PER_TENSOR, 24, 80, 8)
    layer = RowParallelLinear(80, 24, False, torch.float32, _tp(1, 2), Fp8Weights())
    layer.weight.weight_loader(layer.weight, loaded)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_block_in == 40
    _check_output(layer, loaded[:, 40:])


def test_a_shard_that_splits_a_block_and_an_unquantized_layer_keep_the_model_dtype():
    split = _loaded(BLOCK, 24, 80, 9)  # 40 inputs a rank: the second block of 24 straddles the shards
    layer = RowParallelLinear(80, 24, False, torch.float32, _tp(1, 2), Fp8Weights())
    layer.weight.weight_loader(layer.weight, split)
    assert layer.weight.dtype == torch.float32
    _check_output(layer, split[:, 40:])
    plain = torch.randn(24, 80)
    unquantized = RowParallelLinear(80, 24, False, torch.float32, method=Fp8Weights())
    unquantized.weight.weight_loader(unquantized.weight, plain)
    assert unquantized.weight.dtype == torch.float32
    _check_output(unquantized, plain)


@pytest.mark.parametrize("order", ["fp8 first", "plain first"])
def test_a_fused_layer_mixing_e4m3_and_unquantized_parts_is_kept_whole_in_the_model_dtype(order):
    fp8, plain = _loaded(BLOCK, 40, 48, 10), torch.randn(40, 48)
    parts = [fp8, plain] if order == "fp8 first" else [plain, fp8]
    layer = MergedColumnParallelLinear(48, [40, 40], False, torch.float32, method=Fp8Weights())
    for shard_id, part in enumerate(parts):
        layer.weight.weight_loader(layer.weight, part, shard_id)
    assert layer.weight.dtype == torch.float32
    _check_output(layer, torch.cat(parts))


def test_cpu_loading_of_an_fp8_checkpoint_stays_unquantized():
    assert isinstance(linear_method(weight_quantization("none", None, "fp8", "cpu")), Unquantized)


def test_cpu_int4_and_fp8_matmuls_never_import_triton():
    """The CUDA kernels are imported on first CUDA use: a CPU process runs without triton."""
    code = (
        "import sys, torch\n"
        "from engine.layers.fp8_matmul import fp8_matmul\n"
        "from engine.layers.int4_matmul import int4_matmul, pack_int4\n"
        "x = torch.randn(2, 64)\n"
        "int4_matmul(x, pack_int4(torch.randint(0, 16, (8, 64))), torch.ones(8, 2), torch.zeros(8, 2))\n"
        "fp8_matmul(x, torch.randn(8, 64).to(torch.float8_e4m3fn), torch.ones(8, 1), 64)\n"
        "print('triton imported:', 'triton' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "triton imported: False" in result.stdout
