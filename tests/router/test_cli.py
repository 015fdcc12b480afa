"""`splitserve serve` / `generate` / `status` / `health` end to end, as separate processes."""
from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.factories import TinySpec

REPO = Path(__file__).resolve().parents[2]
SPLITSERVE = [sys.executable, "-m", "splitserve.cli"]


def _lines(stream, sink: queue.Queue) -> None:
    for line in stream:
        sink.put(line)


def _wait_for(lines: queue.Queue, pattern: str, timeout_s: float, seen: list) -> re.Match:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s; output:\n{''.join(seen)}")


def _unix_http_get(path, url: str) -> bytes:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(10)
        conn.connect(str(path))
        conn.sendall(f"GET {url} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
        return b"".join(iter(lambda: conn.recv(65536), b""))


def _run(args, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(SPLITSERVE + args, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)


def test_serve_generate_status_and_health_end_to_end(checkpoint, tmp_path):
    socket_path, http_socket = tmp_path / "router.sock", tmp_path / "http.sock"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    serve = subprocess.Popen(SPLITSERVE + ["serve", "--model", str(checkpoint(TinySpec())), "--port", "0",
                                           "--uds", str(socket_path), "--policy", "prefix_hash",
                                           "--http-port", "0", "--http-uds", str(http_socket)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(serve.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        address = _wait_for(lines, r"router listening on (127\.0\.0\.1:\d+)", 120, seen).group(1)
        hint = _wait_for(lines, r"try:  (splitserve generate .*)", 10, seen).group(1)
        assert f"--target unix:{socket_path}" in hint
        # --http-port 0: no TCP port; the HTTP API on the unix socket only
        _wait_for(lines, rf"OpenAI-compatible API on unix:{re.escape(str(http_socket))}$", 10, seen)
        assert _unix_http_get(http_socket, "/health").startswith(b"HTTP/1.1 200")
        generated = _run(["generate", "--target", address, "--max-tokens", "8", "--ignore-eos", "--usage", "hello"])
        assert generated.returncode == 0, generated.stderr
        assert re.search(r"\[8 tokens, 0/\d+ prompt tokens cached, prefill \w+/prefill-0", generated.stdout)
        over_socket = _run(["generate", "--target", f"unix:{socket_path}", "--max-tokens", "8", "--ignore-eos",
                            "hello"])
        assert over_socket.returncode == 0 and over_socket.stdout == generated.stdout.split("[")[0].rstrip() + "\n"
        status = _run(["status", "--target", address])
        assert status.returncode == 0 and "policy prefix_hash" in status.stdout
        rows = {line.split()[0]: line.split() for line in status.stdout.splitlines() if "/prefill-" in line
                or "/decode-" in line}
        assert [row[1:5] for row in rows.values()] == [["prefill", "serving", "1", "0"], ["decode", "serving", "2", "0"]]  # epochs: start order
        assert _run(["health", "--target", address]).stdout.strip() == "SERVING"
        # The unix socket `make run` prints is a target every client command takes.
        assert "policy prefix_hash" in _run(["status", "--target", f"unix:{socket_path}"]).stdout
        assert _run(["health", "--target", f"unix:{socket_path}"]).stdout.strip() == "SERVING"
        bad = _run(["generate", "--target", address, "--temperature", "-1", "hi"])
        assert bad.returncode != 0 and "sampling.temperature" in bad.stderr
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
            raise
    assert serve.returncode == 0, "".join(seen)
    assert _run(["health", "--target", address, "--timeout-s", "1"]).returncode != 0


def test_serve_rejects_a_bad_flag_value_naming_it(tmp_path):
    done = _run(["serve", "--policy", "random"], timeout_s=60)
    assert done.returncode != 0 and "router.policy" in done.stderr
    config = tmp_path / "cluster.yaml"
    config.write_text("decode:\n  tp_size: 3\n")
    done = _run(["serve", "--config", str(config)], timeout_s=60)
    assert done.returncode != 0 and "decode.tp_size" in done.stderr
