"""A Ray cluster that outlives the processes using it (`ray start --head`), for tests of routers and
controllers coming and going. It is ended by PID: every process it started carries its own temporary
directory in its command line, so exactly those are killed — never the test session's own Ray, which
`ray stop --force` would take too."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.sandbox_guard import require_sandbox

RAY = str(Path(sys.executable).parent / "ray")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RayHead:
    def __init__(self, num_cpus: int = 4):
        require_sandbox()
        self.temp_dir = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # Ray's socket paths must stay short
        self.port = free_port()
        subprocess.run([RAY, "start", "--head", "--port", str(self.port), "--num-cpus", str(num_cpus),
                        "--temp-dir", self.temp_dir, "--include-dashboard=false", "--disable-usage-stats"],
                       check=True, capture_output=True, timeout=120)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def pids(self) -> list[int]:
        mine = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if self.temp_dir.encode() in (entry / "cmdline").read_bytes():
                    mine.append(int(entry.name))
            except OSError:  # gone meanwhile
                continue
        return mine

    def stop(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)
