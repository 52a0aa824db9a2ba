"""Regenerate the Python stubs in stagemesh/v1/ from protos/stagemesh/v1/*.proto.

Usage: python scripts/gen_protos.py [OUTPUT_ROOT]   (default: the repository root)
Needs grpcio-tools (the `test` extra pins the version the committed stubs come from).
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO = Path(__file__).resolve().parent.parent
# The include root: imports name the files as stagemesh/v1/<name>.proto. The wheel ships them
# beside the stubs (setup.py copies them in at build time).
PROTO_ROOT = REPO / "protos"


def generate(out_root: Path) -> list[Path]:
    sources = sorted(PROTO_ROOT.glob("stagemesh/v1/*.proto"))
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in sources],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    package = out_root / "stagemesh" / "v1"
    (package / "__init__.py").touch()
    return sorted(package.glob("*_pb2*.py*"))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO
    for path in generate(target):
        print(path)
