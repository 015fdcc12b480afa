"""The alert and recording rules (deploy/helm/splitserve/files/splitserve-rules.yaml) pass `promtool check
rules`, and `promtool test rules` shows each alert firing for one model and quiet for another
(alert_rules_test.yaml beside this file). Debian's `prometheus` package ships promtool (`make test-deps`)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RULES = REPO / "deploy" / "helm" / "splitserve" / "files" / "splitserve-rules.yaml"
FIXTURES = HERE / "alert_rules_test.yaml"


def promtool(*args: str, cwd: Path = HERE) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary is not None, "promtool is not installed: run scripts/install_prometheus.sh (make test-deps)"
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_rules_are_valid():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_each_alert_fires_and_stays_quiet_in_the_fixtures():
    result = promtool("test", "rules", FIXTURES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
              if "alert" in rule}
    cases = [case for test in yaml.safe_load(FIXTURES.read_text())["tests"] for case in test["alert_rule_test"]]
    # Every alert has a case where it fires; promtool matches the firing set exactly, so the models of the same
    # case that are listed nowhere (each case has one within bounds) are checked to stay quiet.
    assert {c["alertname"] for c in cases if c["exp_alerts"]} == alerts


def test_a_wrong_expectation_fails(tmp_path):
    """promtool compares what fires with what the fixtures expect: the pass above means something."""
    fixtures = yaml.safe_load(FIXTURES.read_text())
    fixtures["rule_files"] = [str(RULES)]
    cases = [c for t in fixtures["tests"] for c in t["alert_rule_test"]]
    case = next(c for c in cases if c["alertname"] == "SplitserveNoHealthyWorker")
    case["exp_alerts"] = case["exp_alerts"][:1]  # leave out the pool with no worker at all
    (tmp_path / "wrong.yaml").write_text(yaml.safe_dump(fixtures))
    result = promtool("test", "rules", "wrong.yaml", cwd=tmp_path)
    assert result.returncode != 0 and "SplitserveNoHealthyWorker" in result.stdout + result.stderr
