"""The one rule that produces the generated gRPC code: `python -m splitserve_client.protocol.regen`.

protoc runs with the repository root as the include path, so the generated modules import each other
as `splitserve_client.protocol.splitserve_v1_pb2` — no rewriting. The output is committed; a test regenerates it
into a temporary folder and checks the bytes are identical (so the proto and the code never drift).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO = "splitserve_client/protocol/splitserve_v1.proto"
REPO_ROOT = Path(__file__).resolve().parents[2]


def generate(out_dir: Path) -> list[Path]:
    """Writes the _pb2, _pb2_grpc and .pyi modules under out_dir/splitserve_client/protocol; returns their paths."""
    from grpc_tools import protoc  # build-time tool: only needed to regenerate

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(REPO_ROOT / PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    stem = out_dir / PROTO.removesuffix(".proto")
    return [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2.pyi"), Path(f"{stem}_pb2_grpc.py")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Regenerate the router's gRPC modules from the proto.")
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
