"""Native CPU kernels, compiled on first use with the system C compiler and loaded with ctypes.

No build step at install and no torch headers: the C source is small and compiles in about a second
into a cache directory keyed by its content hash and instruction-set variant (`$SPLITSERVE_KERNEL_DIR`,
default ~/.cache/splitserve/kernels). Each kernel has one source and several variants (compiler flags:
AVX-512, AVX2, the baseline; engine/kernels/isa.py), and the one loaded is the best the running CPU
supports, or `SPLITSERVE_CPU_ISA`'s; `loaded_variants()` says which each kernel took. Where no
compiler works, `decode_attention_kernel()` returns None and the engine uses its PyTorch path;
`SPLITSERVE_ATTENTION=torch` forces that path for attention. Kernels: `paged_decode_attention.c`
(decode attention over fp32 / int8 / fp8 caches) and `int8_linear.c` / `fp32_linear.c` (skinny
matmuls for a few rows, int8 or fp32 weights, both from `skinny_linear.h`); `int4_linear.c` and
`int8_group_linear.c` (the same for group-wise int4 and int8 weights); `widen.h` is their shared
int8 / fp8 → fp32 widening.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from engine.kernels.isa import IsaVariant, candidates, supported_variants, variant_named

KERNEL_DIR = Path(__file__).parent
# Common to every variant; the target's instruction set comes from the variant's flags (isa.py).
CFLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared", "-pthread", "-Wno-psabi"]
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# name → (C signature): each kernel is `int name(...)` in `name.c`, returning 0 on success.
SIGNATURES = {
    "paged_decode_attention": [_PTR] * 8 + [_I64] * 9 + [ctypes.c_float, _I64, _I64],
    "int8_linear": [_PTR] * 4 + [_I64] * 4,
    "fp32_linear": [_PTR] * 4 + [_I64] * 4,
    "int4_linear": [_PTR] * 5 + [_I64] * 5,
    "int8_group_linear": [_PTR] * 4 + [_I64] * 5,
}
_lock = threading.Lock()
_kernels: dict[tuple[str, str | None], object] = {}  # memo: (name, variant asked for) → function or None
_loaded: dict[str, str] = {}  # kernel name → the variant serving it (variant=None calls)
log = logging.getLogger(__name__)


def decode_attention_kernel():
    """The compiled `paged_decode_attention` C function, or None where it cannot be built."""
    if os.environ.get("SPLITSERVE_ATTENTION") == "torch":
        return None
    return kernel("paged_decode_attention")


def kernel(name: str, variant: str | None = None):
    """The compiled C function `name` (a key of SIGNATURES), or None where it cannot be built.

    `variant` None: the variant this process serves with (`SPLITSERVE_CPU_ISA`'s, else the best this
    CPU runs; an override the CPU cannot run raises `IsaError`). A variant's name builds and loads that
    one whether or not the CPU runs it (tests and benchmarks compare variants side by side)."""
    with _lock:
        key = (name, variant)
        if key not in _kernels:
            tried = candidates() if variant is None else (variant_named(variant),)
            _kernels[key] = _load_first(name, tried, serving=variant is None)
        return _kernels[key]


def loaded_variants() -> dict[str, str]:
    """Kernel name → the instruction-set variant serving it, for the kernels loaded so far."""
    with _lock:
        return dict(_loaded)


def _load_first(name: str, variants: tuple[IsaVariant, ...], serving: bool):
    """The first of `variants` that builds (an older compiler may lack AVX-512 flags), or None."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found; %s falls back to PyTorch", name)
        return None
    for variant in variants:
        function = _load(compiler, name, variant)
        if function is not None:
            if serving:
                _loaded[name] = variant.name
                supported = ", ".join(v.name for v in supported_variants())
                log.info("%s kernel: the %s variant (this CPU supports %s)", name, variant.name, supported)
            return function
    log.warning("no variant of the %s kernel could be built; falling back to PyTorch", name)
    return None


def library_path(name: str, variant: IsaVariant) -> Path:
    """Where the `variant` build of kernel `name` is cached: named by both and by a digest of the
    source, the shared headers and the flags (editing any of them rebuilds)."""
    parts = [_source(name).read_bytes(), *(h.read_bytes() for h in sorted(KERNEL_DIR.glob("*.h")))]
    digest = hashlib.blake2b(b"\0".join([*parts, " ".join(_flags(variant)).encode()]), digest_size=8).hexdigest()
    cache = Path(os.environ.get("SPLITSERVE_KERNEL_DIR", Path.home() / ".cache" / "splitserve" / "kernels"))
    return cache / f"{name}-{variant.name}-{digest}.so"


def _source(name: str) -> Path:
    return KERNEL_DIR / f"{name}.c"


def _flags(variant: IsaVariant) -> list[str]:
    return [*CFLAGS, *variant.cflags]


def _load(compiler: str, name: str, variant: IsaVariant):
    library = library_path(name, variant)
    try:
        if not library.exists():
            _compile(compiler, _flags(variant), _source(name), library)
        function = getattr(ctypes.CDLL(str(library)), name)
    except (OSError, subprocess.CalledProcessError) as err:
        log.warning("could not build the %s variant of the %s kernel (%s)", variant.name, name, err)
        return None
    function.restype = ctypes.c_int
    function.argtypes = SIGNATURES[name]
    return function


def _compile(compiler: str, flags: list[str], source: Path, library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name, then rename: concurrent processes never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=library.parent, suffix=".so", delete=False) as handle:
        partial = Path(handle.name)
    try:
        subprocess.run(
            [compiler, *flags, f"-I{KERNEL_DIR}", str(source), "-o", str(partial), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(partial, library)
    finally:
        partial.unlink(missing_ok=True)
