"""Runs a checks module of a Triton kernel under Triton's CPU interpreter, in a fresh process: the
interpreter needs triton imported with `TRITON_INTERPRET=1` already set."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, passed_line: str, *args: str, timeout_s: float = 240) -> None:
    """`python -m module *args` interpreted; asserts it exits 0 and prints `passed_line`."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert passed_line in result.stdout
