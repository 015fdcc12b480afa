"""Native CPU kernels, compiled on first use with the system C compiler and loaded with ctypes.

No build step at install and no torch headers: the C source is small and compiles in about a second
into a cache directory keyed by its content hash (`$SPLITSERVE_KERNEL_DIR`, default
~/.cache/splitserve/kernels). Where no compiler works, `decode_attention_kernel()` returns None and
the engine uses its PyTorch path; `SPLITSERVE_ATTENTION=torch` forces that path.
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

SOURCE = Path(__file__).with_name("paged_decode_attention.c")
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared", "-pthread"]
_lock = threading.Lock()
_kernel: list = []  # memo: [function or None]
log = logging.getLogger(__name__)


def decode_attention_kernel():
    """The compiled `paged_decode_attention` C function, or None where it cannot be built."""
    with _lock:
        if not _kernel:
            _kernel.append(None if os.environ.get("SPLITSERVE_ATTENTION") == "torch" else _load())
        return _kernel[0]


def _load():
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found; decode attention uses the PyTorch path")
        return None
    source = SOURCE.read_bytes()
    digest = hashlib.blake2b(source + " ".join(CFLAGS).encode(), digest_size=8).hexdigest()
    cache = Path(os.environ.get("SPLITSERVE_KERNEL_DIR", Path.home() / ".cache" / "splitserve" / "kernels"))
    library = cache / f"paged_decode_attention-{digest}.so"
    try:
        if not library.exists():
            _compile(compiler, library)
        function = ctypes.CDLL(str(library)).paged_decode_attention
    except (OSError, subprocess.CalledProcessError) as err:
        log.warning("could not build the decode attention kernel (%s); using the PyTorch path", err)
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_int64]
    return function


def _compile(compiler: str, library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name, then rename: concurrent processes never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=library.parent, suffix=".so", delete=False) as handle:
        partial = Path(handle.name)
    try:
        subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", str(partial), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(partial, library)
    finally:
        partial.unlink(missing_ok=True)
