"""Pool services as real processes for tests: start, wait for SERVING, read metrics, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    """This environment without EPD_* variables, which every service reads as flags."""
    return {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen
    port: int
    metrics_port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def health(self, service: str = "") -> int | None:
        try:
            with self.channel() as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=2
                )
            return reply.status
        except grpc.RpcError:
            return None

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """(sample name, sorted labels) -> value, from the /metrics endpoint."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 40.0) -> int:
        """SIGTERM, then the exit code (killed and -9 if it does not exit in time)."""
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                return -9
        return self.process.returncode


def spawn(name: str, module: str, args: list[str], workdir: Path) -> ServiceProcess:
    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-m", module, "--port", str(port), "--metrics-port", str(metrics_port), *args]
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=clean_env(), cwd=REPO_ROOT)
    return ServiceProcess(name, process, port, metrics_port, log)


def wait_serving(services: list[ServiceProcess], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    for service in services:
        while service.health() != health_pb2.HealthCheckResponse.SERVING:
            if service.process.poll() is not None:
                raise RuntimeError(f"{service.name} exited with {service.process.returncode}:\n{service.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service.name} did not report SERVING in {timeout_s:g} s:\n{service.output()}")
            time.sleep(0.1)


def wait_for(condition, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()
