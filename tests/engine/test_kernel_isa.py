"""Instruction-set variants of the C kernels (engine/kernels/isa.py): every variant this CPU runs builds
and gives the torch reference's results for each kernel, variant beside variant through the engine's
own calling code; the generic and AVX2 builds hold no wider instructions than their names say (a
shared kernel cache run on an older CPU cannot fault); `SPLITSERVE_CPU_ISA` is honoured, and one
the CPU lacks fails in one line naming the variable and the variants it supports."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from engine import attention, kernels
from engine.kernels import isa
from engine.layers import dense_matmul, int4_matmul, int8_group_matmul, int8_matmul
from engine.layers.quantization import quantize_per_channel
from tests.engine.test_attention import _case

log = logging.getLogger(__name__)
ALL_VARIANTS = [v.name for v in isa.machine_variants()]
RUNNABLE = {v.name for v in isa.supported_variants()}
# instruction registers a variant's build must not touch: wider than its name allows
FORBIDDEN_REGISTERS = {"avx2": ("%zmm",), "generic": ("%ymm", "%zmm")}


def _runnable_variants() -> list[str]:
    """The variants to compare; the others are reported, never silently dropped."""
    exercised = [v for v in ALL_VARIANTS if v in RUNNABLE]
    missing = [v for v in ALL_VARIANTS if v not in RUNNABLE]
    if missing:
        log.warning("not compared: this CPU cannot run the %s kernel variants", missing)
    log.info("kernel variants compared: %s", exercised)
    return exercised


def _per_variant(monkeypatch, module, attribute: str, run) -> dict[str, torch.Tensor]:
    """run() once per runnable variant, with `module.attribute` (its kernel lookup) bound to that variant."""
    lookup = getattr(module, attribute)
    results = {}
    for variant in _runnable_variants():
        if attribute == "decode_attention_kernel":
            monkeypatch.setattr(module, attribute, lambda v=variant: kernels.kernel("paged_decode_attention", v))
        else:
            monkeypatch.setattr(module, attribute, lambda name, v=variant: kernels.kernel(name, v))
        results[variant] = run()
    monkeypatch.setattr(module, attribute, lookup)
    assert len(results) >= 1 and "generic" in results  # the baseline runs on every CPU of the machine
    return results


def _assert_all_close(results: dict[str, torch.Tensor], expected: torch.Tensor, rtol: float, atol: float) -> None:
    for variant, got in results.items():
        torch.testing.assert_close(
            got.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m, v=variant: f"{v}: {m}"
        )
    first = next(iter(results.values()))
    for variant, got in results.items():  # the variants agree with each other up to summation order
        torch.testing.assert_close(got, first, rtol=rtol, atol=atol, msg=lambda m, v=variant: f"{v}: {m}")


def test_linear_kernels_agree_across_variants_and_with_torch(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    # 5 rows and 37 outputs: neither a multiple of the row tile nor of any variant's channel tile;
    # 200 inputs: a tail after the widest vector.
    x = torch.randn(5, 200, generator=gen)
    weight = torch.randn(37, 200, generator=gen)

    dense = _per_variant(monkeypatch, dense_matmul, "kernel", lambda: dense_matmul.dense_linear(x, weight))
    _assert_all_close(dense, x.double() @ weight.double().t(), rtol=1e-5, atol=1e-4)

    values, scale = quantize_per_channel(weight)
    int8 = _per_variant(monkeypatch, int8_matmul, "kernel", lambda: int8_matmul._native(x, values, scale))
    _assert_all_close(int8, x.double() @ (values.double() * scale.double()[:, None]).t(), rtol=1e-5, atol=1e-4)

    grouped, group_scale = int8_group_matmul.quantize_groupwise(weight[:, :192], 64)
    int8g = _per_variant(
        monkeypatch, int8_group_matmul, "kernel", lambda: int8_group_matmul._native(x[:, :192], grouped, group_scale)
    )
    expected = x[:, :192].double() @ int8_group_matmul.dequantize_groupwise(grouped, group_scale).double().t()
    _assert_all_close(int8g, expected, rtol=1e-5, atol=1e-4)

    packed = int4_matmul.pack_int4(torch.randint(0, 16, (37, 192), generator=gen))
    int4_scale = torch.rand(37, 3, generator=gen) + 0.05
    zero = torch.randint(0, 16, int4_scale.shape, generator=gen).float()
    int4 = _per_variant(
        monkeypatch, int4_matmul, "kernel", lambda: int4_matmul._native(x[:, :192], packed, int4_scale, zero)
    )
    expected = x[:, :192].double() @ int4_matmul.dequantize_int4(packed, int4_scale, zero).double().t()
    _assert_all_close(int4, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_decode_attention_agrees_across_variants_and_with_torch(monkeypatch, kv_cache_dtype):
    q, cache, _, padded, native_meta = _case(8, 2, 72, 16, [1, 17, 90], kv_cache_dtype, seed=3)
    layer, scale = cache.layer(0), 72**-0.5
    k, v = (cache.fmt.dequantize(t, s) for t, s in ((layer.k, layer.k_scale), (layer.v, layer.v_scale)))
    expected = attention._decode_attention(q, k, v, padded, scale)
    results = _per_variant(
        monkeypatch,
        attention,
        "decode_attention_kernel",
        lambda: attention._decode_attention_native(q, layer, native_meta, scale),
    )
    _assert_all_close(results, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("name", sorted(kernels.SIGNATURES))
def test_builds_use_no_wider_registers_than_their_variant(name):
    """Any CPU of the machine runs the generic build, any AVX2 CPU the avx2 build: the disassembly
    names no register of a wider extension (objdump ships with the binutils the compiler needs)."""
    for variant in ALL_VARIANTS:
        assert kernels.kernel(name, variant) is not None, f"the {variant} variant of {name} did not build"
    for variant in ALL_VARIANTS:
        library = kernels.library_path(name, isa.variant_named(variant))
        disassembly = subprocess.run(
            ["objdump", "-d", str(library)], check=True, capture_output=True, text=True, timeout=60
        ).stdout
        for register in FORBIDDEN_REGISTERS.get(variant, ()):
            assert register not in disassembly, f"{library.name} uses {register}"


def _in_subprocess(code: str, isa_value: str | None) -> subprocess.CompletedProcess:
    env_prefix = "" if isa_value is None else f"import os; os.environ['{isa.ISA_ENV}'] = {isa_value!r}; "
    return subprocess.run(
        [sys.executable, "-c", env_prefix + code], capture_output=True, text=True, timeout=120, check=False
    )


def test_the_override_is_honoured_and_the_default_is_the_best_variant():
    code = (
        "from engine import kernels; from engine.kernels import isa; "
        "assert kernels.kernel('int8_linear') is not None; "
        "print(kernels.loaded_variants()['int8_linear'], isa.supported_variants()[0].name)"
    )
    for value in sorted(RUNNABLE):
        result = _in_subprocess(code, value)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split()[0] == value
    default = _in_subprocess(code, None)
    assert default.returncode == 0, default.stderr
    loaded, best = default.stdout.split()
    assert loaded == best


def test_an_override_this_cpu_lacks_fails_naming_the_variable_and_the_supported_variants():
    avx2_only = isa.runnable(isa.machine_variants("x86_64"), frozenset({"avx2", "fma", "f16c", "sse2"}), "")
    assert [v.name for v in avx2_only] == ["avx2", "generic"]
    with pytest.raises(isa.IsaError) as raised:
        isa.choose("avx512", avx2_only)
    message = "SPLITSERVE_CPU_ISA='avx512' is not supported by this CPU; supported here: avx2, generic"
    assert str(raised.value) == message
    assert [v.name for v in isa.choose(None, avx2_only)] == ["avx2", "generic"]
    # torch's capability where /proc/cpuinfo is absent
    by_torch = isa.runnable(isa.machine_variants("x86_64"), None, "AVX2")
    assert [v.name for v in by_torch] == ["avx2", "generic"]
    assert [v.name for v in isa.machine_variants("aarch64")] == ["generic"]
    # end to end: an unknown value fails at the first kernel, in one line
    result = _in_subprocess("from engine import kernels; kernels.kernel('int8_linear')", "sse9")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        f"engine.kernels.isa.IsaError: SPLITSERVE_CPU_ISA='sse9' is not supported by this CPU; "
        f"supported here: {', '.join(v.name for v in isa.supported_variants())}"
    )
