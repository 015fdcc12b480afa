"""A private `redis-server` for tests and benches: loopback only, no persistence, a free port.

Fault tests kill it (SIGKILL, by PID), pause it (SIGSTOP: a hung server) and start it again on the
same port, which is how a Redis restart looks to clients (all data gone: nothing is persisted).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    def __init__(self, port: int | None = None, workdir: str | None = None):
        self.port = port or _free_port()
        self._owns_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="redis-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        """Start on `self.port` and return once it answers PING; raise with its log if it does not."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"redis-server already running on port {self.port}")
        log = self.workdir / "redis.log"
        self._proc = subprocess.Popen(
            [*self._command(), "--logfile", str(log)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                text = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
                raise RuntimeError(f"redis-server did not answer PING on port {self.port}:\n{text}")
            time.sleep(0.01)
        return self

    def _command(self) -> list[str]:
        return [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--daemonize", "no"]

    def ping(self, timeout_s: float = 0.2) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL by PID and reap: the abrupt death a crash looks like. No-op when not running."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGKILL)  # kills a paused (SIGSTOPped) server too
        self._proc.wait(timeout=10)
        self._proc = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers, as with a hung or partitioned server."""
        os.kill(self._require_pid(), signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self._require_pid(), signal.SIGCONT)

    def restart(self, timeout_s: float = 10.0) -> "RedisServer":
        self.kill()
        return self.start(timeout_s)

    def _require_pid(self) -> int:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError("redis-server is not running")
        return self._proc.pid

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _free_port() -> int:
    # The OS picks; the tiny window before redis-server binds it is acceptable on a test machine.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
