"""The generated gRPC code is exactly what the one regeneration rule produces from the proto."""
from __future__ import annotations

from pathlib import Path

from splitserve_client.protocol import regen

REPO = Path(__file__).resolve().parents[2]


def test_regenerating_gives_identical_bytes(tmp_path):
    for generated in regen.generate(tmp_path):
        committed = REPO / generated.relative_to(tmp_path)
        assert committed.read_bytes() == generated.read_bytes(), (
            f"{committed.relative_to(REPO)} is stale: run `python -m splitserve_client.protocol.regen`")


def test_every_rpc_and_field_has_a_comment():
    lines = (REPO / regen.PROTO).read_text().splitlines()
    for number, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("rpc ") or (stripped.endswith(";") and "=" in stripped):
            assert lines[number - 1].strip().startswith("//"), f"line {number + 1} has no comment: {stripped}"
