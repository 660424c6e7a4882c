"""Regenerate the committed Python stubs from the .proto files: `python -m protos.generate`.

The stubs are committed (no build step at install); tests/deploy/test_protos.py fails when they are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ["protos/kvflow/v1/kvflow.proto"]


def generate(out_dir: Path = ROOT) -> None:
    from grpc_tools import protoc

    for proto in PROTO_FILES:
        code = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
                            f"--grpc_python_out={out_dir}", str(ROOT / proto)])
        if code != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {code})")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
