"""Prints the lower bound of every runtime dependency in pyproject.toml as an exact pin, one a line:
the requirements of a venv that holds exactly the oldest versions the project claims to support
(`make lower-venv`; tests/test_lower_bounds.py runs a request there).

    python scripts/lower_bounds.py pyproject.toml > lower-bounds.txt

A dependency without a lower bound (`>=` or `==`) is an error: the claim would be untestable.
"""
from __future__ import annotations

import re
import sys
import tomllib

_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*)(;.*)?$")


def lower_bound_pin(requirement: str) -> str:
    """'numpy>=2.0.0,<3' -> 'numpy==2.0.0'; extras are kept ('redis[hiredis]==8.0.0')."""
    match = _REQUIREMENT.match(requirement)
    if match is None or match.group(4):
        raise ValueError(f"cannot read requirement {requirement!r} (markers are not supported here)")
    name, extras, specifiers = match.group(1), match.group(2) or "", match.group(3)
    for spec in (s.strip() for s in specifiers.split(",") if s.strip()):
        if spec.startswith(("==", ">=")) and not spec.startswith("==="):
            return f"{name}{extras}=={spec[2:].strip()}"
    raise ValueError(f"{requirement!r} has no lower bound (>= or ==)")


def main(argv: list[str]) -> None:
    path = argv[0] if argv else "pyproject.toml"
    with open(path, "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    for requirement in dependencies:
        print(lower_bound_pin(requirement))


if __name__ == "__main__":
    main(sys.argv[1:])
