"""Run the whole E/P/D cluster on this machine: one command, real processes.

    python -m services.cluster                  # tiny checkpoint, filesystem EC store
    python -m services.cluster --ec redis       # EC store in a local redis-server
    python -m services.cluster --checkpoint /models/Qwen2.5-VL-7B-Instruct --device cuda --dtype bfloat16

Starts the EC store (a directory, or redis-server), the encoder(s), prefill and decode
(or one PD worker), then the proxy; prints the proxy's URL; Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

STOP_TIMEOUT_S = 40.0


@dataclass(frozen=True)
class ClusterConfig:
    checkpoint: Path | None = None  # None: the tiny checkpoint, created if missing
    ec: str = "fs"  # "fs" | "redis"
    encoders: int = 1
    pd: bool = False  # one PD worker instead of separate prefill and decode
    http_port: int = 8000
    grpc_port: int = 0  # the proxy's gRPC front door; 0 picks a free port
    host: str = "127.0.0.1"
    device: str = "cpu"
    dtype: str = "float32"
    num_blocks: int = 1024
    workdir: Path | None = None  # logs and the filesystem EC store; default: a temp dir
    extra_proxy_args: tuple[str, ...] = ()
    ready_timeout_s: float = 180.0


@dataclass
class Service:
    name: str
    process: subprocess.Popen
    port: int
    metrics_port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self, chars: int | None = 4000) -> str:
        """The log's last `chars` characters (all of it for None)."""
        text = self.log.read_text(errors="replace")
        return text if chars is None else text[-chars:]

    def terminate(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then the exit code (killed and -9 if it does not exit in time)."""
        if self.alive():
            self.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                return -9
        return self.process.returncode


@dataclass
class LocalCluster:
    config: ClusterConfig
    services: list[Service] = field(default_factory=list)
    ec_url: str = ""
    workdir: Path = Path()
    model_name: str = ""
    proxy_grpc_port: int = 0
    _own_workdir: bool = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "LocalCluster":
        cfg = self.config
        self._own_workdir = cfg.workdir is None
        self.workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="epd-cluster-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        checkpoint = self._checkpoint()
        self.model_name = checkpoint.name
        try:
            self.ec_url = self._start_ec_store()
            common = ["--checkpoint", str(checkpoint), "--device", cfg.device, "--dtype", cfg.dtype]
            store = ["--ec-store", self.ec_url]
            for i in range(cfg.encoders):
                self._spawn_pool(f"encoder-{i}", "services.encoder", common + store)
            lm = common + ["--num-blocks", str(cfg.num_blocks)]
            if cfg.pd:
                self._spawn_pool("pd", "services.pd", lm + store)
            else:
                self._spawn_pool("prefill", "services.prefill", lm + store)
                self._spawn_pool("decode", "services.decode", lm)
            for service in self.services:
                if service.name != "redis":
                    self._wait_grpc_ready(service)
            self._spawn_proxy(checkpoint)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Proxy first (it drains its requests), then the pools, then the store."""
        for service in reversed(self.services):
            service.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ addresses

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def pool(self, prefix: str) -> list[Service]:
        return [s for s in self.services if s.name.startswith(prefix)]

    @property
    def proxy(self) -> Service:
        return self.service("proxy")

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.proxy.port}/v1"

    @property
    def grpc_address(self) -> str:
        return f"{self.config.host}:{self.proxy_grpc_port}"

    def metrics(self, name: str) -> str:
        port = self.service(name).metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            return resp.read().decode()

    # ------------------------------------------------------------------ internals

    def _checkpoint(self) -> Path:
        if self.config.checkpoint is not None:
            return Path(self.config.checkpoint).resolve()
        from services.models.tiny_checkpoint import ensure_tiny_checkpoint

        return ensure_tiny_checkpoint()

    def _start_ec_store(self) -> str:
        if self.config.ec == "fs":
            root = self.workdir / "ec-store"
            root.mkdir(exist_ok=True)
            return f"file://{root}"
        if self.config.ec != "redis":
            raise ValueError(f"--ec must be 'fs' or 'redis', got {self.config.ec!r}")
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("--ec redis needs redis-server on the PATH (apt-get install redis-server)")
        port = free_port()
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self._spawn("redis", args, port, 0)
        _wait(lambda: _redis_ping(port), self.config.ready_timeout_s, "redis-server did not answer PING")
        return f"redis://127.0.0.1:{port}/0"

    def _spawn_pool(self, name: str, module: str, args: list[str]) -> None:
        port, metrics_port = free_port(), free_port()
        command = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port)]
        self._spawn(name, command + ["--metrics-port", str(metrics_port)] + args, port, metrics_port)

    def _spawn_proxy(self, checkpoint: Path) -> None:
        cfg = self.config
        self.proxy_grpc_port = cfg.grpc_port or free_port()
        metrics_port = cfg.http_port  # the proxy serves /metrics on its HTTP port
        if cfg.pd:
            pools = ["--prefills", self.service("pd").address, "--decodes", self.service("pd").address]
        else:
            pools = ["--prefills", self.service("prefill").address, "--decodes", self.service("decode").address]
        command = [
            sys.executable, "-m", "services.proxy",
            "--checkpoint", str(checkpoint),
            "--host", cfg.host,
            "--http-port", str(cfg.http_port),
            "--grpc-port", str(self.proxy_grpc_port),
            "--ec-store", self.ec_url,
            "--encoders", ",".join(s.address for s in self.pool("encoder-")),
            *pools,
            *cfg.extra_proxy_args,
        ]  # fmt: skip
        proxy = self._spawn("proxy", command, cfg.http_port, metrics_port)
        url = f"http://{cfg.host}:{cfg.http_port}/health"
        _wait(lambda: _http_ok(url) or self._died(proxy), cfg.ready_timeout_s, f"the proxy did not get healthy ({url})")
        self._check_alive(proxy)

    def _spawn(self, name: str, command: list[str], port: int, metrics_port: int) -> Service:
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        service = Service(name, process, port, metrics_port, log)
        self.services.append(service)
        return service

    def _wait_grpc_ready(self, service: Service) -> None:
        def serving() -> bool:
            self._check_alive(service)
            return _grpc_serving(service.address)

        _wait(serving, self.config.ready_timeout_s, f"{service.name} did not report SERVING; see {service.log}")

    def _died(self, service: Service) -> bool:
        self._check_alive(service)
        return False

    def _check_alive(self, service: Service) -> None:
        if not service.alive():
            raise RuntimeError(f"{service.name} exited with code {service.process.returncode}:\n{service.output(2000)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(ready, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{message} within {timeout_s:g} s")


def _grpc_serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="HF checkpoint directory (default: the tiny checkpoint)")
    parser.add_argument("--ec", choices=["fs", "redis"], default="fs", help="EC store backend (default: fs)")
    parser.add_argument("--encoders", type=int, default=1, help="encoder replicas (default: 1)")
    parser.add_argument("--pd", action="store_true", help="one PD worker instead of separate prefill and decode")
    parser.add_argument("--port", type=int, default=8000, help="the proxy's HTTP port (default: 8000)")
    parser.add_argument("--grpc-port", type=int, default=50051, help="the proxy's gRPC port (default: 50051)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per language-model pool")
    parser.add_argument("--workdir", type=Path, help="where logs (and the fs EC store) go (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.encoders < 1:
        parser.error("--encoders must be >= 1")
    config = ClusterConfig(
        checkpoint=args.checkpoint,
        ec=args.ec,
        encoders=args.encoders,
        pd=args.pd,
        http_port=args.port,
        grpc_port=args.grpc_port,
        device=args.device,
        dtype=args.dtype,
        num_blocks=args.num_blocks,
        workdir=args.workdir,
    )
    cluster = LocalCluster(config)
    # Explicit for SIGINT too: a shell that starts us in the background sets it to "ignore".
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    print("starting the EPD cluster (models load in each process; this takes a little while) ...", flush=True)
    try:
        cluster.start()
        _print_ready(cluster)
        while all(s.alive() for s in cluster.services):
            time.sleep(0.5)
        dead = [f"{s.name} (exit {s.process.returncode}, log {s.log})" for s in cluster.services if not s.alive()]
        print(f"a service stopped: {', '.join(dead)}; shutting down", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        cluster.stop()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _print_ready(cluster: LocalCluster) -> None:
    lines = [
        f"EPD cluster ready: {cluster.base_url}  (model {cluster.model_name!r}, gRPC {cluster.grpc_address})",
        f"  EC store: {cluster.ec_url}",
        *(f"  {s.name}: {s.address}  log {s.log}" for s in cluster.services if s.name != "redis"),
        "Try:",
        f"  curl -s {cluster.base_url}/chat/completions -H 'Content-Type: application/json' \\",
        f'    -d \'{{"model": "{cluster.model_name}", "messages": [{{"role": "user", "content": "Hello!"}}]}}\'',
        "Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
