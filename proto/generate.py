"""Generate the Python gRPC stubs from proto/epd.proto into services/rpc/.

    python proto/generate.py           # (re)write the stubs
    python proto/generate.py --check   # exit 1 if the checked-in stubs are stale

Pinned grpcio-tools (see pyproject's `dev` extra) keeps the output reproducible.
"""
from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "proto" / "epd.proto"
PACKAGE = "services/rpc"  # the stubs import each other as services.rpc.*
OUTPUTS = ("epd_pb2.py", "epd_pb2.pyi", "epd_pb2_grpc.py")


def generate(out_root: Path) -> None:
    include = protoc._get_resource_file_name("grpc_tools", "_proto")
    args = [
        "protoc",
        f"-I{PACKAGE}={PROTO.parent}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"{PROTO.parent}/{PROTO.name}",
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def stale_files(stubs: Path) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / PACKAGE
        return [n for n in OUTPUTS if not (stubs / n).exists() or not filecmp.cmp(fresh / n, stubs / n, shallow=False)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the checked-in stubs differ from fresh ones")
    parser.add_argument("--stubs", type=Path, default=ROOT / PACKAGE, help="stub directory to check")
    args = parser.parse_args()
    if args.check:
        stale = stale_files(args.stubs)
        if stale:
            print(f"stale stubs in {args.stubs}: {stale}; run `python proto/generate.py`", file=sys.stderr)
            return 1
        return 0
    generate(ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
