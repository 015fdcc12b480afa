"""Tests that start Ray (or anything else that binds every interface) must run inside the private
network namespace scripts/in_sandbox.sh makes (scripts/run_tests.sh runs the suite there)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def require_sandbox() -> None:
    """Fails the calling test when a private namespace could be made here but this is not one."""
    if os.environ.get("SPLITSERVE_IN_SANDBOX") == "1" or shutil.which("unshare") is None:
        return
    probe = subprocess.run(["unshare", "-n", "-p", "-f", "--mount-proc", "true"], capture_output=True, timeout=10)
    if probe.returncode == 0:
        pytest.fail("this test starts Ray, which binds every interface: run it through scripts/run_tests.sh")
