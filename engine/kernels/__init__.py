"""Native CPU kernels, compiled on first use with the system C compiler and loaded with ctypes.

No build step at install and no torch headers: the C source is small and compiles in about a second
into a cache directory keyed by its content hash (`$SPLITSERVE_KERNEL_DIR`, default
~/.cache/splitserve/kernels). Where no compiler works, `decode_attention_kernel()` returns None and
the engine uses its PyTorch path; `SPLITSERVE_ATTENTION=torch` forces that path for attention.
Kernels: `paged_decode_attention.c` (decode attention over fp32 / int8 / fp8 caches) and
`int8_linear.c` / `fp32_linear.c` (skinny matmuls for a few rows, int8 or fp32 weights, both from
`skinny_linear.h`); `int4_linear.c` and `int8_group_linear.c` (the same for group-wise int4 and int8
weights); `widen.h` is their shared
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

KERNEL_DIR = Path(__file__).parent
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared", "-pthread", "-Wno-psabi"]
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# name → (C signature): each kernel is `int name(...)` in `name.c`, returning 0 on success.
SIGNATURES = {
    "paged_decode_attention": [_PTR] * 8 + [_I64] * 9 + [ctypes.c_float, _I64],
    "int8_linear": [_PTR] * 4 + [_I64] * 4,
    "fp32_linear": [_PTR] * 4 + [_I64] * 4,
    "int4_linear": [_PTR] * 5 + [_I64] * 5,
    "int8_group_linear": [_PTR] * 4 + [_I64] * 5,
}
_lock = threading.Lock()
_kernels: dict[str, object] = {}  # memo: name → function or None
log = logging.getLogger(__name__)


def decode_attention_kernel():
    """The compiled `paged_decode_attention` C function, or None where it cannot be built."""
    if os.environ.get("SPLITSERVE_ATTENTION") == "torch":
        return None
    return kernel("paged_decode_attention")


def kernel(name: str):
    """The compiled C function `name` (a key of SIGNATURES), or None where it cannot be built."""
    with _lock:
        if name not in _kernels:
            _kernels[name] = _load(name)
        return _kernels[name]


def _load(name: str):
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found; %s falls back to PyTorch", name)
        return None
    source = KERNEL_DIR / f"{name}.c"
    # The digest covers the shared headers too: editing one rebuilds every kernel.
    parts = [source.read_bytes(), *(h.read_bytes() for h in sorted(KERNEL_DIR.glob("*.h"))), " ".join(CFLAGS).encode()]
    digest = hashlib.blake2b(b"\0".join(parts), digest_size=8).hexdigest()
    cache = Path(os.environ.get("SPLITSERVE_KERNEL_DIR", Path.home() / ".cache" / "splitserve" / "kernels"))
    library = cache / f"{name}-{digest}.so"
    try:
        if not library.exists():
            _compile(compiler, source, library)
        function = getattr(ctypes.CDLL(str(library)), name)
    except (OSError, subprocess.CalledProcessError) as err:
        log.warning("could not build the %s kernel (%s); falling back to PyTorch", name, err)
        return None
    function.restype = ctypes.c_int
    function.argtypes = SIGNATURES[name]
    return function


def _compile(compiler: str, source: Path, library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name, then rename: concurrent processes never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=library.parent, suffix=".so", delete=False) as handle:
        partial = Path(handle.name)
    try:
        subprocess.run(
            [compiler, *CFLAGS, f"-I{KERNEL_DIR}", str(source), "-o", str(partial), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(partial, library)
    finally:
        partial.unlink(missing_ok=True)
