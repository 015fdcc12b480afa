"""Serving processes as a user starts them (`splitserve serve`, `splitserve router`), for tests: started
with a bounded wait for their "listening" line, ended by PID."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

LISTENING = re.compile(r"router listening on (\S+)")


class ServingProcess:
    def __init__(self, args: list[str], ready_timeout_s: float = 180.0):
        self.proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.target = self._wait_listening(ready_timeout_s)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def _wait_listening(self, timeout_s: float) -> str:
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            match = LISTENING.search(line)
            if match:
                return match.group(1)
        self.kill()
        raise AssertionError(f"{self.proc.args} did not start listening:\n{''.join(self.output)[-3000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
