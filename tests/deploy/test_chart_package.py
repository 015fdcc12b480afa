"""The chart as a package: its README's values table is generated from values.schema.json (every
value described), Chart.yaml carries the metadata a chart repository shows, and .helmignore keeps
editor and VCS debris out of `helm package`."""
from __future__ import annotations

import fnmatch
import json

import yaml

from tests.deploy.chart import CHART_DIR
from tests.scripts import load_script

chart_readme = load_script("chart_readme")


def test_readme_values_table_is_generated_from_the_schema():
    readme = (CHART_DIR / "README.md").read_text()
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert chart_readme.render(readme, schema, values) == readme, "stale: python scripts/chart_readme.py"
    documented = {row[0] for row in chart_readme.rows(schema, values)}
    assert {"router.replicas", "tls.certManager.issuerRef.name", "test.prompt", "config.prefill.threads"} <= documented


def _leaves(values: dict, prefix: str = "") -> set[str]:
    found = set()
    for key, value in values.items():
        if isinstance(value, dict) and value and key not in ("resources", "volume"):
            found |= _leaves(value, f"{prefix}{key}.")
        else:
            found.add(prefix + key)
    return found


def test_every_default_value_has_a_row():
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    documented = {row[0] for row in chart_readme.rows(schema, values)}
    missing = {leaf for leaf in _leaves(values)
               if not any(leaf == d or leaf.startswith(d + ".") or d.startswith(leaf + ".") for d in documented)}
    assert missing == set()


def test_chart_metadata():
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["type"] == "application"
    assert chart["home"].startswith("https://") and all(s.startswith("https://") for s in chart["sources"])
    assert chart["maintainers"] and all(m["name"] for m in chart["maintainers"])
    assert chart["kubeVersion"].startswith(">=1.27")


def test_helmignore_keeps_debris_out_and_the_chart_in():
    patterns = [ln.strip() for ln in (CHART_DIR / ".helmignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]

    def ignored(path: str) -> bool:
        parts = path.split("/")
        return any(fnmatch.fnmatch(parts[-1], p) or (p.endswith("/") and p[:-1] in parts[:-1] + [parts[-1]])
                   for p in patterns)

    for debris in (".git/config", "templates/router-service.yaml.swp", "values.yaml~", ".vscode/settings.json",
                   ".DS_Store", "values.yaml.orig"):
        assert ignored(debris), debris
    shipped = [p.relative_to(CHART_DIR).as_posix() for p in CHART_DIR.rglob("*") if p.is_file()]
    assert {"Chart.yaml", "values.yaml", "values.schema.json", "README.md", "templates/NOTES.txt"} <= set(shipped)
    assert [p for p in shipped if ignored(p) and p != ".helmignore"] == []
