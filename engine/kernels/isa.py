"""Instruction-set variants of the C kernels, and which one this CPU runs.

Each kernel is compiled once per variant from the same source: a variant is a set of compiler flags,
and the sources pick their vector width and intrinsics from the macros those flags define
(`__AVX512F__`, `__AVX2__`; widen.h). The variant is chosen when the kernel is loaded, from the CPU
the process runs on, never from the machine that compiled it: a kernel cache shared over NFS or baked
into an image and then run on another CPU model loads a variant that CPU has.

x86-64 has `avx512`, `avx2` and `generic` (the x86-64 baseline, SSE2); every x86 variant pins
`-march=x86-64` first, so a compiler whose default target is newer adds nothing the CPU may lack.
Other machines (aarch64) have `generic` alone: the compiler's default target, whose baseline there
already includes NEON.

The CPU's features are read from /proc/cpuinfo's `flags` on Linux: it names each extension a variant
needs separately (AVX-512 is several), and the kernel lists only what it has enabled (it drops AVX-512
when the OS does not save its registers, as in some VMs). Where that file is absent (macOS, Windows),
`torch.backends.cpu.get_cpu_capability()` answers (AVX512 / AVX2 / DEFAULT, as ATen's own kernels are
dispatched). `SPLITSERVE_CPU_ISA` names a variant to use instead; one this CPU lacks fails naming the
variable and the variants it supports.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ISA_ENV = "SPLITSERVE_CPU_ISA"
_CPUINFO = Path("/proc/cpuinfo")
_X86_BASE = ("-march=x86-64", "-mtune=generic")


class IsaError(ValueError):
    """`SPLITSERVE_CPU_ISA` names a variant that is unknown or that this CPU cannot run."""


@dataclass(frozen=True)
class IsaVariant:
    name: str
    cflags: tuple[str, ...]  # added to the kernels' common flags
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags the variant's instructions need
    torch_capabilities: frozenset[str]  # get_cpu_capability() values that imply them (no /proc/cpuinfo)


AVX512 = IsaVariant(
    "avx512",
    (*_X86_BASE, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"),
    frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
    frozenset({"AVX512"}),
)
AVX2 = IsaVariant(
    "avx2",
    (*_X86_BASE, "-mavx2", "-mfma", "-mf16c"),
    frozenset({"avx2", "fma", "f16c"}),
    frozenset({"AVX512", "AVX2"}),
)
GENERIC_X86 = IsaVariant("generic", _X86_BASE, frozenset(), frozenset())
GENERIC = IsaVariant("generic", (), frozenset(), frozenset())

# machine (platform.machine()) → its variants, best first; any other machine has GENERIC alone
VARIANTS_BY_MACHINE: dict[str, tuple[IsaVariant, ...]] = {
    "x86_64": (AVX512, AVX2, GENERIC_X86),
    "amd64": (AVX512, AVX2, GENERIC_X86),
}


def machine_variants(machine: str | None = None) -> tuple[IsaVariant, ...]:
    """Every variant built for `machine` (default: this one), best first."""
    return VARIANTS_BY_MACHINE.get((machine or platform.machine()).lower(), (GENERIC,))


def variant_named(name: str) -> IsaVariant:
    """The variant `name` of this machine (kernels built for a variant this CPU may not run, as tests do)."""
    for variant in machine_variants():
        if variant.name == name:
            return variant
    raise IsaError(f"unknown CPU kernel variant {name!r}; known here: {_names(machine_variants())}")


def runnable(
    variants: tuple[IsaVariant, ...], cpu_flags: frozenset[str] | None, capability: str
) -> tuple[IsaVariant, ...]:
    """The variants a CPU runs, best first: by its /proc/cpuinfo flags, or where those are unknown
    (None) by torch's capability string."""
    if cpu_flags is not None:
        return tuple(v for v in variants if v.cpu_flags <= cpu_flags)
    return tuple(v for v in variants if not v.torch_capabilities or capability in v.torch_capabilities)


@cache
def supported_variants() -> tuple[IsaVariant, ...]:
    """The variants this CPU runs, best first (the last needs nothing beyond the machine's baseline)."""
    flags = _cpuinfo_flags()
    capability = "" if flags is not None else _torch_capability()
    return runnable(machine_variants(), flags, capability)


def choose(override: str | None, supported: tuple[IsaVariant, ...]) -> tuple[IsaVariant, ...]:
    """The variants to try in order: the override alone, or every supported one, best first."""
    if not override:
        return supported
    for variant in supported:
        if variant.name == override:
            return (variant,)
    raise IsaError(f"{ISA_ENV}={override!r} is not supported by this CPU; supported here: {_names(supported)}")


def candidates() -> tuple[IsaVariant, ...]:
    """What the kernels load for this process: `SPLITSERVE_CPU_ISA`'s variant, else the best this CPU
    runs (and the ones after it, where the compiler cannot build it)."""
    return choose(os.environ.get(ISA_ENV, "").strip().lower() or None, supported_variants())


def _names(variants: tuple[IsaVariant, ...]) -> str:
    return ", ".join(v.name for v in variants)


def _cpuinfo_flags() -> frozenset[str] | None:
    try:
        text = _CPUINFO.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":  # x86 spells it `flags`; aarch64's `Features` needs no variant here
            return frozenset(value.split())
    return frozenset() if platform.machine().lower() not in VARIANTS_BY_MACHINE else None


def _torch_capability() -> str:
    import torch

    return str(torch.backends.cpu.get_cpu_capability())
