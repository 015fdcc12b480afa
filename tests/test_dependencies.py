"""The dependency story holds together: pyproject.toml says what the code needs (runtime + extras),
requirements.txt locks every package `make` installs, the bounds agree with the committed generated
code, nothing is declared that nothing uses, and the version is written in one place."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import splitserve

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# Every top-level package of the distribution (the layering contract lists them all).
PRODUCT = tuple(PYPROJECT["tool"]["importlinter"]["root_packages"])
# Distribution -> the module it is imported as, where the names differ.
IMPORT_NAMES = {"grpcio": "grpc", "grpcio-health-checking": "grpc_health", "grpcio-reflection": "grpc_reflection",
                "grpcio-tools": "grpc_tools", "protobuf": "google.protobuf", "pyyaml": "yaml",
                "prometheus-client": "prometheus_client", "helm-python-sdk": "helm_python",
                "kubernetes-validate": "kubernetes_validate", "huggingface-hub": "huggingface_hub",
                "opentelemetry-api": "opentelemetry", "opentelemetry-sdk": "opentelemetry.sdk",
                "opentelemetry-exporter-otlp-proto-grpc": "opentelemetry.exporter.otlp.proto.grpc",
                "opentelemetry-proto": "opentelemetry.proto", "xgrammar": "xgrammar",
                "llguidance": "llguidance", "outlines-core": "outlines_core"}
# Declared but never imported, on purpose: (distribution, why).
NOT_IMPORTED = {"hiredis": "redis-py's C reply parser, used by redis-py when present",
                "pytest-timeout": "a pytest plugin: the suite's per-test timeout (pyproject [tool.pytest])",
                "pytest-xdist": "a pytest plugin: `make test TEST_WORKERS=2` runs the suite on two processes",
                "accelerate": "transformers loads a block-scaled FP8 checkpoint itself only with it installed",
                "httptools": "uvicorn's HTTP parser, loaded by name (http='httptools') in benchmarks/http_stack_servers.py",
                "ruff": "`make lint`: a command-line tool", "mypy": "`make lint`: a command-line tool",
                "import-linter": "`make lint`: the layering contract ([tool.importlinter] in pyproject.toml)",
                **{f"types-{name}": "stubs mypy reads in `make lint`"
                   for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "pyyaml", "tqdm")}}


def _lock() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version.strip(), f"requirements.txt: {line!r} is not an exact pin"
            assert canonicalize_name(name) not in pins, f"requirements.txt pins {name} twice"
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _declared() -> list[Requirement]:
    """Every requirement in pyproject.toml, runtime and extras, self-references (splitserve[plot]) left out."""
    groups = [PYPROJECT["project"]["dependencies"], *PYPROJECT["project"]["optional-dependencies"].values()]
    return [r for r in (Requirement(text) for group in groups for text in group) if r.name != "splitserve"]


def test_every_declared_dependency_is_locked_within_its_bounds():
    lock = _lock()
    for requirement in _declared():
        name = canonicalize_name(requirement.name)
        assert name in lock, f"{requirement} is not pinned in requirements.txt: run `make lock`"
        assert requirement.specifier.contains(lock[name], prereleases=True), f"{name}=={lock[name]} breaks {requirement}"
        for extra in requirement.extras:  # e.g. redis[hiredis]: the extra's packages are locked too
            assert canonicalize_name(extra) in lock or extra == "hiredis", extra


def test_the_lock_starts_with_torch_pinned():
    first = next(line for line in (REPO / "requirements.txt").read_text().splitlines() if not line.startswith("#"))
    assert first == f"torch=={_lock()['torch']}"
    torch = next(r for r in map(Requirement, PYPROJECT["project"]["dependencies"]) if r.name == "torch")
    assert str(torch.specifier) == f"=={_lock()['torch']}", "torch is pinned in pyproject too"


def test_extras_are_split_from_the_runtime_set():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(extras) == {"test", "dev", "plot", "bench"}
    runtime = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]}
    for never_served in ("pytest", "hypothesis", "helm-python-sdk", "matplotlib", "scipy", "grpcio-tools",
                         "kubernetes-validate", "cryptography"):
        assert never_served not in runtime, never_served


def test_bounds_match_the_committed_generated_code():
    """The generated modules refuse older runtimes than the ones that generated them."""
    runtime = {canonicalize_name(r.name): r for r in map(Requirement, PYPROJECT["project"]["dependencies"])}
    pb2 = (REPO / "splitserve_client/protocol/splitserve_v1_pb2.py").read_text()
    protobuf = re.search(r"# Protobuf Python Version: (\d+)\.(\d+)\.(\d+)", pb2).groups()
    assert runtime["protobuf"].specifier.contains(".".join(protobuf))
    assert not runtime["protobuf"].specifier.contains(f"{int(protobuf[0])}.{int(protobuf[1]) - 1}.99")
    assert not runtime["protobuf"].specifier.contains(f"{int(protobuf[0]) + 1}.0.0"), "a new major breaks it"
    grpc = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (REPO / "splitserve_client/protocol/splitserve_v1_pb2_grpc.py")
                     .read_text()).group(1)
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert runtime[name].specifier.contains(grpc) and not runtime[name].specifier.contains("1.85.0"), name
    tools = next(r for r in map(Requirement, PYPROJECT["project"]["optional-dependencies"]["dev"]))
    assert str(tools.specifier) == f"=={grpc}", "grpcio-tools must be the generator of the committed code"


def _imported_top_modules(folders) -> set[str]:
    names = set()
    for folder in folders:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module)
    return names


def _is_imported(distribution: str, modules: set[str]) -> bool:
    wanted = IMPORT_NAMES.get(distribution, distribution.replace("-", "_"))
    return any(m == wanted or m.startswith(wanted + ".") for m in modules)


def test_nothing_is_declared_that_nothing_imports():
    product = _imported_top_modules(PRODUCT)
    everything = product | _imported_top_modules(["tests", "scripts"])
    for requirement in map(Requirement, PYPROJECT["project"]["dependencies"]):
        name = canonicalize_name(requirement.name)
        assert _is_imported(name, product) or name in NOT_IMPORTED, f"no product module imports {name}"
    for requirement in _declared():
        name = canonicalize_name(requirement.name)
        assert _is_imported(name, everything) or name in NOT_IMPORTED, f"nothing imports {name}"


def test_the_version_is_written_once():
    assert PYPROJECT["project"]["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "splitserve.__version__"}
    chart = yaml.safe_load((REPO / "deploy/helm/splitserve/Chart.yaml").read_text())
    assert chart["appVersion"] == splitserve.__version__
    done = subprocess.run([sys.executable, "-m", "splitserve.cli", "--version"], capture_output=True, text=True,
                          cwd=REPO, timeout=30, check=True)
    assert done.stdout.startswith(f"splitserve {splitserve.__version__} (Python ")
    assert "torch " in done.stdout and "grpcio " in done.stdout


def test_the_sdk_distribution_matches_the_release():
    """sdk/pyproject.toml builds the client SDK alone: the release's version and the server's bounds on the
    two packages it needs."""
    sdk = tomllib.loads((REPO / "sdk/pyproject.toml").read_text())["project"]
    assert sdk["version"] == splitserve.__version__
    runtime = {canonicalize_name(Requirement(r).name): str(Requirement(r).specifier)
               for r in PYPROJECT["project"]["dependencies"]}
    needs = {canonicalize_name(Requirement(r).name): str(Requirement(r).specifier) for r in sdk["dependencies"]}
    assert set(needs) == {"grpcio", "protobuf"}
    assert all(runtime[name] == spec for name, spec in needs.items()), (needs, runtime)
