"""A real Prometheus server for tests: Debian's `prometheus` binary on a free loopback port, with a
temporary config and storage folder, scraping the given targets every second and evaluating rule files
every second. Queried through its HTTP API, as Grafana and promtool do."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

INTERVAL = "1s"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrometheusServer:
    def __init__(self, workdir: Path, targets: dict[str, list[str]], rule_files: tuple[Path, ...] = ()):
        binary = shutil.which("prometheus")
        assert binary is not None, "prometheus is not installed: run scripts/install_prometheus.sh (make test-deps)"
        config = {
            "global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL, "scrape_timeout": INTERVAL},
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": hosts}]}
                               for job, hosts in targets.items()],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = (workdir / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        self.workdir = workdir

    def api(self, path: str, timeout_s: float = 10.0, **params) -> dict:
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def wait(self, what: str, check, timeout_s: float = 30.0) -> None:
        """Polls `check()` (truthy: done) until the deadline; fails naming `what` and the server's log."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (self.workdir / "prometheus.log").read_text()
            try:
                if check():
                    return
            except OSError:  # not listening yet
                pass
            time.sleep(0.25)
        log = (self.workdir / "prometheus.log").read_text()
        raise AssertionError(f"Prometheus: {what} within {timeout_s} s; log:\n{log}")

    def wait_targets_up(self, count: int) -> None:
        def up() -> bool:
            targets = self.api("targets")["activeTargets"]
            return len(targets) == count and all(t["health"] == "up" for t in targets)

        self.wait(f"{count} targets up", up)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        self._log.close()
