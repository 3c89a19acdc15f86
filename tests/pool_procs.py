"""Pool services as real processes for tests: start, wait for SERVING, read metrics, stop."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from services.cluster import Service, free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


def clean_env() -> dict[str, str]:
    """This environment without EPD_* variables, which every service reads as flags."""
    return {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}


class ServiceProcess(Service):
    """A pool service (services.cluster.Service: address, output, stop) with gRPC health and metrics helpers."""

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
