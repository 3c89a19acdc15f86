"""The checked-in gRPC stubs are exactly what proto/generate.py makes from proto/epd.proto."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check(stubs: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "proto/generate.py", "--check", "--stubs", str(stubs)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True)


def test_stubs_are_fresh():
    result = check(ROOT / "services/rpc")
    assert result.returncode == 0, result.stderr


def test_check_notices_a_stale_stub(tmp_path):
    stubs = tmp_path / "rpc"
    shutil.copytree(ROOT / "services/rpc", stubs)
    with open(stubs / "epd_pb2.py", "a") as f:
        f.write("\n# edited by hand\n")
    result = check(stubs)
    assert result.returncode == 1 and "epd_pb2.py" in result.stderr
