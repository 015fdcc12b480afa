"""schemathesis's `st run` against a running router's HTTP front, from the document it serves.

`run_fuzz(http_url, workdir, max_time_s=..., max_examples=...)` runs the CLI in a process of its own
(the router serves on a thread of the calling process, as in the tests), with every built-in check but
the positive-data one, which `http_fuzz_checks` replaces with splitserve's (a valid body may be refused
only for a rule the document lists), and returns the run's JSON report. The time budget bounds the
whole run: the examples and coverage phases enumerate the schema once, then fuzzing repeats rounds of
`max_examples` cases per operation until the budget is spent. Used by tests/router/test_http_fuzz.py
(a ~40 s run) and benchmarks/http_fuzz.py (the deeper run, which records examples/s).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKS_MODULE = "tests.router.http_fuzz_checks"
# A 504 is the request's own timeout_ms (http_fuzz_checks.deadline_only_when_asked holds it to that);
# any other 5xx is a failure.
_CONFIG = """\
hooks = "{hooks}"
workers = 1
request-timeout = 120
continue-on-failure = true

[checks]
positive_data_acceptance.enabled = false
not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "504"]
"""


@dataclass(frozen=True)
class FuzzRun:
    exit_code: int
    report: dict  # schemathesis's JSON report (--report json)
    output: str  # the CLI's stdout and stderr: the failures, with curl commands that reproduce them

    @property
    def generated(self) -> int:
        return self.report["test_cases"]["generated"]

    @property
    def running_time_s(self) -> float:
        return self.report["running_time"]

    @property
    def examples_per_s(self) -> float:
        return self.generated / self.running_time_s if self.running_time_s else 0.0


def run_fuzz(
    http_url: str,
    workdir: Path,
    *,
    max_time_s: int,
    max_examples: int,
    seed: int = 0,
    token: str | None = None,
    checks_module: str = CHECKS_MODULE,
) -> FuzzRun:
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "schemathesis.toml"
    config.write_text(_CONFIG.format(hooks=checks_module))
    report = workdir / "report.json"
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color",
        "run", f"{http_url}/openapi.json",
        "--max-time", str(max_time_s),
        "--max-examples", str(max_examples),
        "--seed", str(seed),
        "--generation-database", "none",
        "--report", "json", "--report-json-path", str(report),
    ]  # fmt: skip
    if token is not None:
        command += ["--header", f"Authorization: Bearer {token}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    # The budget bounds the run; loading the document and the last requests in flight come on top. It runs in
    # `workdir`: schemathesis keeps its state (a crash cache) in ./.schemathesis.
    done = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=max_time_s + 180, check=False
    )
    output = done.stdout + done.stderr
    if not report.exists():
        raise RuntimeError(f"st run wrote no report (exit {done.returncode}):\n{output[-4000:]}")
    return FuzzRun(done.returncode, json.loads(report.read_text()), output)
