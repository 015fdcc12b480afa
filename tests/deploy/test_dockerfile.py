"""deploy/docker/Dockerfile and the build context, checked without Docker: the invariants an image
build must keep (torch pinned and first, non-root numeric user, gRPC health check) and that the
image agrees with the chart (uid, port, Ray version)."""
from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from pathlib import PurePosixPath

import yaml

from tests.deploy.chart import CHART_DIR, REPO

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
# Suffixes of files the packages read at run time (kernel source, corpora, data tables).
RUNTIME_DATA_SUFFIXES = (".c", ".txt", ".json", ".yaml")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        keyword, _, rest = current.strip().partition(" ")
        logical.append((keyword.upper(), " ".join(rest.split())))
        current = ""
    return logical


def arg_defaults() -> dict[str, str]:
    return dict(args.split("=", 1) for kind, args in instructions() if kind == "ARG" and "=" in args)


def expand(text: str) -> str:
    defaults = arg_defaults()
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults.get(m.group(1) or m.group(2), m.group(0)), text)


def requirement_pin(name: str) -> str:
    for line in (REPO / "requirements.txt").read_text().splitlines():
        if line.strip().startswith(f"{name}=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"{name} is not pinned in requirements.txt")


def chart_values() -> dict:
    return yaml.safe_load((CHART_DIR / "values.yaml").read_text())


def _index_of(kind: str, needle: str) -> int:
    hits = [i for i, (k, args) in enumerate(instructions()) if k == kind and needle in args]
    assert hits, f"no {kind} containing {needle!r}"
    return hits[0]


def test_cpu_base_by_default_and_any_base_by_build_arg():
    assert arg_defaults()["BASE_IMAGE"] == "python:3.11-slim"
    (base,) = [args for kind, args in instructions() if kind == "FROM"]
    assert base == "${BASE_IMAGE}"
    assert arg_defaults()["TORCH_INDEX_URL"].endswith("/whl/cpu")


def test_torch_is_pinned_as_in_requirements_and_installed_first():
    assert arg_defaults()["TORCH_VERSION"] == requirement_pin("torch")
    torch = _index_of("RUN", '"torch==${TORCH_VERSION}"')
    assert '--index-url "$TORCH_INDEX_URL"' in instructions()[torch][1]
    requirements = _index_of("RUN", "pip install -c /tmp/deps/requirements.txt -r /tmp/deps/runtime.txt")
    project = _index_of("RUN", "pip install --no-deps /tmp/src")
    assert torch < requirements < project
    assert not any("pip install" in args for _, args in instructions()[:torch]), "something installed before torch"


def test_the_image_installs_the_runtime_set_only_under_the_lock():
    """No test, dev or plot extra reaches the serving image: the packages installed are exactly
    pyproject's [project] dependencies, at the lock's versions."""
    step = instructions()[_index_of("RUN", "/tmp/deps/runtime.txt")][1]
    assert "['project']['dependencies']" in step and "optional-dependencies" not in step
    assert "pip check" in step
    copied = [args for kind, args in instructions() if kind == "COPY" and "/tmp/deps/" in args]
    assert copied == ["pyproject.toml requirements.txt /tmp/deps/"]
    installs = [args for kind, args in instructions() if kind == "RUN" and "pip install" in args]
    assert not any("[" in args.split("pip install", 1)[1].split("&&")[0] for args in installs), "an extra is installed"


def test_runs_as_the_numeric_non_root_user_the_chart_expects():
    users = [expand(args) for kind, args in instructions() if kind == "USER"]
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0, "Kubernetes' runAsNonRoot needs a numeric uid"
    security = chart_values()["podSecurity"]
    assert (int(uid), int(gid)) == (security["runAsUser"], security["runAsGroup"])


def test_healthcheck_asks_the_grpc_health_service_on_the_served_port_and_both_ports_are_exposed():
    (check,) = [args for kind, args in instructions() if kind == "HEALTHCHECK"]
    command = json.loads(check.split(" CMD ", 1)[1])
    assert command[:3] == ["splitserve", "health", "--target"]
    host, port = command[3].rsplit(":", 1)
    assert host == "127.0.0.1"
    (exposed,) = [args for kind, args in instructions() if kind == "EXPOSE"]
    grpc_port, http_port = exposed.split()
    served = json.loads([args for kind, args in instructions() if kind == "CMD"][-1])
    router = chart_values()["router"]
    assert port == grpc_port == served[served.index("--port") + 1] == str(router["port"])
    assert http_port == served[served.index("--http-port") + 1] == str(router["httpPort"])
    assert json.loads([args for kind, args in instructions() if kind == "ENTRYPOINT"][-1]) == ["splitserve"]


def test_chart_ray_version_is_the_image_ray_version():
    assert chart_values()["ray"]["version"] == requirement_pin("ray")


def _packages() -> list[str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]


def test_build_context_allow_lists_every_package():
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()]
    allowed = {ln[1:] for ln in lines if ln.startswith("!")}
    assert "**" in lines, "the context is an allow-list"
    assert {"pyproject.toml", "README.md", "requirements.txt", *_packages()} <= allowed


def _ships(path: PurePosixPath, package_data: dict[str, list[str]]) -> bool:
    for package, patterns in package_data.items():
        root = PurePosixPath(*package.split("."))
        if root not in path.parents:
            continue
        rel = path.relative_to(root)
        for pattern in map(PurePosixPath, patterns):
            if len(pattern.parts) == len(rel.parts) and all(map(fnmatch.fnmatch, rel.parts, pattern.parts)):
                return True
    return False


def test_installed_project_ships_the_files_it_reads_at_run_time():
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    missing = []
    for package in _packages():
        for path in sorted((REPO / package).rglob("*")):
            if path.suffix in RUNTIME_DATA_SUFFIXES and "__pycache__" not in path.parts:
                rel = PurePosixPath(path.relative_to(REPO).as_posix())
                if not _ships(rel, package_data):
                    missing.append(str(rel))
    assert missing == []
