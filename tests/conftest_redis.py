"""Pytest plugin: a throwaway real redis-server for the test session.

Load with `pytest_plugins = ["tests.conftest_redis"]`. Tests isolate themselves
with a unique key prefix (or FLUSHDB).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

_START_TIMEOUT_S = 10.0
_START_ATTEMPTS = 3  # a free port can be taken between probing and binding


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_ping(proc: subprocess.Popen, url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    deadline = time.monotonic() + _START_TIMEOUT_S
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if client.ping():
                    return True
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        return False
    finally:
        client.close()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start(binary: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    log = workdir / "redis.log"
    for _ in range(_START_ATTEMPTS):
        port = _free_port()
        cmd = [
            binary,
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--bind",
            "127.0.0.1",
            "--dir",
            str(workdir),
            "--logfile",
            str(log),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        url = f"redis://127.0.0.1:{port}/0"
        if _wait_for_ping(proc, url):
            return proc, url
        _stop(proc)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
    raise RuntimeError(f"redis-server did not answer PING after {_START_ATTEMPTS} attempts:\n{tail}")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not found on PATH (install the redis-server package)")
    proc, url = _start(binary, tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        _stop(proc)
