"""The pre-quantized checkpoint formats' layouts against small examples worked out by hand, and the
checks that name the tensor or `quantization_config` key a checkpoint gets wrong."""

from __future__ import annotations

import pytest
import torch

from engine.errors import UnsupportedModelError
from engine.quantization import checkpoint_format
from engine.quantization.assembly import WeightAssembler
from engine.quantization.awq import AWQ_ORDER, AwqFormat
from engine.quantization.fp8 import Fp8Format
from engine.quantization.gptq import GptqFormat
from engine.quantization.packing import pack, unpack


def _int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def test_gptq_4bit_packs_eight_input_features_per_word_lowest_bits_first():
    values = torch.tensor([[1], [2], [3], [4], [5], [6], [7], [8]])  # [in=8, out=1]
    assert pack(values, 4, dim=0).tolist() == [[_int32(0x87654321)]]
    assert unpack(torch.tensor([[_int32(0x87654321)]], dtype=torch.int32), 4, dim=0).flatten().tolist() == list(
        range(1, 9)
    )


def test_gptq_8bit_packs_four_values_per_word():
    assert pack(torch.tensor([[0x11, 0x22, 0x33, 0xF4]]), 8, dim=1).tolist() == [[_int32(0xF4332211)]]


def test_awq_gemm_interleaves_eight_output_channels_in_its_order():
    # Outputs 0..7 hold the values 0..7: slot k holds output AWQ_ORDER[k] = 0, 2, 4, 6, 1, 3, 5, 7.
    word = pack(torch.arange(8)[None], 4, dim=1, order=AWQ_ORDER)
    assert word.tolist() == [[0x75316420]]
    assert unpack(word, 4, dim=1, order=AWQ_ORDER).tolist() == [list(range(8))]


def test_pack_round_trips_and_rejects_values_outside_the_bit_width():
    values = torch.randint(0, 16, (16, 24), generator=torch.Generator().manual_seed(0))
    for dim in (0, 1):
        assert torch.equal(unpack(pack(values, 4, dim), 4, dim), values.int())
    with pytest.raises(ValueError, match="values must lie in"):
        pack(torch.tensor([[16, 0, 0, 0, 0, 0, 0, 0]]), 4, dim=1)


def _gptq_parts(version: str) -> dict[str, torch.Tensor]:
    # in=8, out=8, one 4-bit group. q[i, o] = i (input i's value, every output); stored zeros 7 (v1) / 8 (v2).
    qweight = torch.full((1, 8), _int32(0x76543210), dtype=torch.int32)
    stored_zero = 7 if version == "gptq" else 8
    qzeros = torch.tensor([[_int32(int(f"{stored_zero:x}" * 8, 16))]], dtype=torch.int32)
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales}


@pytest.mark.parametrize("version", ["gptq", "gptq_v2"])
def test_gptq_dequantizes_with_the_zero_point_convention_of_its_version(version):
    fmt = GptqFormat(bits=4, group_size=-1, sym=True, desc_act=False, version=version)
    weight = fmt.dequantize("layer", _gptq_parts(version))
    # Both store the true zero point 8: weight[o, i] = 0.5 * (i - 8).
    assert weight.tolist() == [[0.5 * (i - 8) for i in range(8)]] * 8


def test_gptq_g_idx_picks_each_input_features_group():
    # in=8 in two groups of 4, assigned out of order by act-order: inputs 0, 2, 4, 6 → group 1.
    fmt = GptqFormat(bits=4, group_size=4, sym=False, desc_act=True, version="gptq_v2")
    parts = _gptq_parts("gptq_v2")
    parts["qzeros"] = torch.tensor([[0], [_int32(0x11111111)]], dtype=torch.int32)  # zeros 0 and 1
    parts["scales"] = torch.tensor([[1.0] * 8, [2.0] * 8], dtype=torch.float16)
    parts["g_idx"] = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0], dtype=torch.int32)
    expected = [2.0 * (i - 1) if i % 2 == 0 else 1.0 * i for i in range(8)]
    assert fmt.dequantize("layer", parts)[3].tolist() == expected


def test_awq_dequantizes_groups_of_input_features():
    fmt = AwqFormat(group_size=64)
    # in=128 (two groups), out=8; q[i, o] = o via the interleaved word; zeros 1 / 2, scales 1 / 0.25.
    qweight = torch.full((128, 1), 0x75316420, dtype=torch.int32)
    qzeros = torch.tensor([[0x11111111], [0x22222222]], dtype=torch.int32)
    scales = torch.tensor([[1.0] * 8, [0.25] * 8], dtype=torch.float16)
    weight = fmt.dequantize("layer", {"qweight": qweight, "qzeros": qzeros, "scales": scales})
    assert weight.shape == (8, 128)
    assert weight[:, 0].tolist() == [o - 1.0 for o in range(8)]
    assert weight[:, 127].tolist() == [0.25 * (o - 2) for o in range(8)]


def test_fp8_block_scales_cover_partial_blocks():
    fmt = Fp8Format(block_size=(2, 3))
    weight = torch.ones(3, 4).to(torch.float8_e4m3fn)  # a 2 x 2 grid, the last row and column partial
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    expected = [[1, 1, 1, 2], [1, 1, 1, 2], [3, 3, 3, 4]]
    assert fmt.dequantize("layer", {"weight": weight, "weight_scale_inv": scale}).tolist() == expected


def test_fp8_per_tensor_and_per_channel_scales():
    fmt = Fp8Format(block_size=None)
    weight = torch.tensor([[1.0, -2.0], [0.5, 4.0]]).to(torch.float8_e4m3fn)
    per_tensor = fmt.dequantize("layer", {"weight": weight, "weight_scale": torch.tensor(3.0)})
    assert per_tensor.tolist() == [[3.0, -6.0], [1.5, 12.0]]
    per_channel = fmt.dequantize("layer", {"weight": weight, "weight_scale": torch.tensor([[2.0], [10.0]])})
    assert per_channel.tolist() == [[2.0, -4.0], [5.0, 40.0]]


def test_an_unknown_method_fails_listing_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match=r"quant_method='bitsandbytes'.*\['awq', 'fp8', 'gptq'\]"):
        checkpoint_format({"quantization_config": {"quant_method": "bitsandbytes"}})


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size=100"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ],
)
def test_unsupported_config_values_fail_naming_the_key(config, key):
    with pytest.raises(UnsupportedModelError, match=key.replace("[", r"\[")):
        checkpoint_format({"quantization_config": config})


def test_tensors_that_disagree_with_the_config_fail_naming_the_tensor():
    # Packed at 4 bits, read as 8 bits: qweight [1, 8] then holds 4 input features, the scales say otherwise.
    weight = torch.randn(8, 8)
    parts = GptqFormat(bits=4, group_size=-1, sym=True, desc_act=False, version="gptq").rtn_parts(weight)
    wrong = GptqFormat(bits=8, group_size=-1, sym=True, desc_act=False, version="gptq")
    with pytest.raises(UnsupportedModelError, match=r"tensor model.layers.0.mlp.up_proj.qzeros has shape"):
        wrong.dequantize("model.layers.0.mlp.up_proj", parts)
    fp8 = Fp8Format(block_size=(4, 4)).rtn_parts(weight)
    with pytest.raises(
        UnsupportedModelError, match=r"tensor lm\.weight_scale_inv has shape \(2, 2\), expected \(1, 1\)"
    ):
        Fp8Format(block_size=(8, 8)).dequantize("lm", fp8)


def test_the_assembler_names_a_missing_part_and_a_tensor_no_format_describes():
    fmt = GptqFormat(bits=4, group_size=-1, sym=True, desc_act=True, version="gptq")
    with pytest.raises(UnsupportedModelError, match=r"lacks tensor a\.proj\.g_idx"):
        WeightAssembler(fmt, ["a.proj.qweight", "a.proj.qzeros", "a.proj.scales"])
    with pytest.raises(UnsupportedModelError, match=r"no tensor ends in"):
        WeightAssembler(fmt, ["a.proj.weight"])
    plain = WeightAssembler(None, ["a.proj.qweight"])
    with pytest.raises(UnsupportedModelError, match=r"tensor a\.proj\.qweight has dtype torch.int32"):
        list(plain.feed("a.proj.qweight", torch.zeros(1, 8, dtype=torch.int32)))


def test_the_assembler_yields_the_weight_once_every_part_arrived_in_any_order():
    fmt = AwqFormat(group_size=64)
    weight = torch.randn(16, 64)
    parts = fmt.rtn_parts(weight)
    assembler = WeightAssembler(fmt, [f"x.{p}" for p in parts] + ["x.bias"])
    assert list(assembler.feed("x.scales", parts["scales"])) == []
    assert [n for n, _ in assembler.feed("x.bias", torch.zeros(16))] == ["x.bias"]
    assert list(assembler.feed("x.qzeros", parts["qzeros"])) == []
    [(name, restored)] = list(assembler.feed("x.qweight", parts["qweight"]))
    assert name == "x.weight" and restored.shape == (16, 64)
    # Rounding to nearest: within half a step of the group's grid (one group: the stored scales' row).
    step = parts["scales"][0].float()
    assert ((restored - weight).abs() <= step[:, None] / 2 + 1e-6).all()
