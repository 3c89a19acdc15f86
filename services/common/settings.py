"""Every pool service's flags, declared once (see flags.py for the --flag / EPD_FLAG rules).

Groups (server, model, EC store, engine) are frozen dataclasses; a service's
settings class combines the groups it needs (listed last-first, so --help shows
the server flags first). Nothing here imports torch, so a
bad flag is reported within a fraction of a second.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from services.common.flags import flag, parse_size

GiB = 1 << 30
MiB = 1 << 20
DTYPES = ("float32", "bfloat16", "float16")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?|mps")
_ADDRESS = re.compile(r"(\[[0-9a-fA-F:.]+\]|[^:\s\[\]]+):(\d{1,5})")
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


# ------------------------------------------------------------------ field checks


def _positive(value: float) -> str | None:
    return None if value > 0 else "must be > 0"


def _non_negative(value: float) -> str | None:
    return None if value >= 0 else "must be >= 0"


def _port(value: int) -> str | None:
    return None if 1 <= value <= 65535 else "ports are 1-65535"


def _metrics_port(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "ports are 1-65535 (0 turns the metrics endpoint off)"


def _checkpoint(path: Path) -> str | None:
    if not path.is_dir():
        return "no such directory; point it at a Hugging Face checkpoint directory"
    if not (path / "config.json").is_file():
        return "no config.json there; point it at a Hugging Face checkpoint directory"
    return None


def _ec_store(url: str) -> str | None:
    parsed = urlparse(url)
    usage = "must be file:///abs/path, a path, or redis://host:port/db"
    if parsed.scheme in ("redis", "rediss"):
        return None if parsed.hostname else usage
    if parsed.scheme == "unix":
        return None if parsed.path else usage
    if parsed.scheme == "file":
        ok = parsed.netloc in ("", "localhost") and parsed.path.startswith("/")
        return None if ok else usage
    return None if parsed.scheme == "" and url.strip() else usage


def _device(value: str) -> str | None:
    return None if _DEVICE.fullmatch(value) else "use cpu, cuda, cuda:N or mps"


def _dtype(value: str) -> str | None:
    return None if value in DTYPES else f"use one of {', '.join(DTYPES)}"


def _address(value: str) -> str | None:
    match = _ADDRESS.fullmatch(value)
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        return "use host:port, as callers on other machines reach this server"
    return None


def is_redis_url(url: str) -> bool:
    return urlparse(url).scheme in ("redis", "rediss", "unix")


# ------------------------------------------------------------------ groups


@dataclass(frozen=True, kw_only=True)
class ServerFlags:
    host: str = flag("127.0.0.1", "interface to serve gRPC on")
    port: int = flag(help="gRPC port", check=_port)
    metrics_port: int = flag(0, "Prometheus /metrics HTTP port on the same host; 0 = off", _metrics_port)
    grace_s: float = flag(30.0, "on SIGTERM/SIGINT, how long in-flight RPCs may take to finish", _non_negative)

    cross_checks = (lambda s: "--metrics-port must differ from --port" if s.metrics_port == s.port else None,)

    @property
    def bind_address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, kw_only=True)
class ModelFlags:
    checkpoint: Path = flag(help="Hugging Face checkpoint directory", check=_checkpoint)
    device: str = flag("cpu", "torch device", _device)
    dtype: str = flag("float32", "weights and activations dtype", _dtype)


@dataclass(frozen=True, kw_only=True)
class ECFlags:
    ec_store: str = flag(help="EC store: file:///abs/path, a path, or redis://host:port/db", check=_ec_store)
    ec_max_bytes: int = flag(8 * GiB, "EC store byte budget (LRU eviction above it)", _positive, parse_size)
    ec_ttl_s: int | None = flag(None, "expire EC entries unused for this long (Redis only)", _positive)

    cross_checks = (
        lambda s: (
            "--ec-ttl-s works only with a redis:// EC store; drop it or use Redis"
            if s.ec_ttl_s is not None and not is_redis_url(s.ec_store)
            else None
        ),
    )

    def ec_options(self) -> dict:
        """Keyword arguments for connectors.ec.open_ec_store."""
        options: dict = {"max_bytes": self.ec_max_bytes}
        if self.ec_ttl_s is not None:
            options["ttl_s"] = self.ec_ttl_s
        return options


@dataclass(frozen=True, kw_only=True)
class EngineFlags:
    block_size: int = flag(16, "tokens per KV block", _positive)
    num_blocks: int = flag(1024, "KV blocks in the pool", _positive)
    max_num_seqs: int = flag(64, "sequences per batch", _positive)
    max_model_len: int | None = flag(None, "context length cap (default: the model's)", _positive)


# ------------------------------------------------------------------ services


@dataclass(frozen=True, kw_only=True)
class EncoderSettings(ECFlags, ModelFlags, ServerFlags):
    """The encoder pool: images -> vision tower -> EC store."""

    max_batch_patches: int = flag(16384, "vision patches per forward pass (an image is never split)", _positive)
    batch_wait_ms: float = flag(5.0, "how long to gather concurrent requests into one batch", _non_negative)


@dataclass(frozen=True, kw_only=True)
class PrefillSettings(EngineFlags, ECFlags, ModelFlags, ServerFlags):
    """The prefill pool: token ids + embeddings -> first token + held KV."""

    advertise_address: str | None = flag(None, "host:port that decoders use to pull KV (default host:port)", _address)
    max_num_batched_tokens: int = flag(8192, "prompt tokens per prefill step", _positive)
    feature_timeout_s: float = flag(30.0, "how long a prompt may wait for its embeddings", _positive)
    kv_hold_timeout_s: float = flag(30.0, "free a prefilled request's KV if not released by then", _positive)
    kv_chunk_bytes: int = flag(MiB, "PullKV message size", _positive, parse_size)

    cross_checks = (
        lambda s: (
            f"--host {s.host} is not an address callers can reach; set --advertise-address host:port"
            if s.advertise_address is None and s.host in _WILDCARD_HOSTS
            else None
        ),
    )

    @property
    def advertise(self) -> str:
        return self.advertise_address or self.bind_address


@dataclass(frozen=True, kw_only=True)
class DecodeSettings(EngineFlags, ModelFlags, ServerFlags):
    """The decode pool: pulls KV from prefill, continuous batching -> streamed tokens."""

    kv_pull_timeout_s: float = flag(30.0, "deadline for pulling one request's KV", _positive)


@dataclass(frozen=True, kw_only=True)
class PDSettings(PrefillSettings, DecodeSettings):
    """One worker serving Prefill and Decode with one engine and one KV pool."""
