"""Proxy configuration: flags (each also read from EPD_<FLAG>), validated once at start."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.multimodal.image_io import ImageLimits

_SIZE_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class PoolSource:
    """Where a pool's replicas are: a fixed list, or every A record of a DNS name."""

    pool: str
    addresses: tuple[str, ...] = ()  # static host:port list
    dns_name: str | None = None  # dns:///name:port
    dns_port: int = 0

    def describe(self) -> str:
        return f"dns:///{self.dns_name}:{self.dns_port}" if self.dns_name else ",".join(self.addresses)


@dataclass(frozen=True)
class ProxyConfig:
    checkpoint: Path
    model_name: str
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 0  # 0 = no gRPC front door
    ec_store: str | None = None
    encoders: PoolSource = PoolSource("encoder")
    prefills: PoolSource = PoolSource("prefill")
    decodes: PoolSource = PoolSource("decode")
    dns_refresh_s: float = 10.0
    allow_http_image_urls: bool = False
    image_fetch_timeout_s: float = 30.0
    max_images_per_prompt: int = 8
    image_limits: ImageLimits = ImageLimits()
    max_model_len: int = 4096
    default_max_tokens: int = 256
    request_timeout_s: float = 120.0
    encode_retries: int = 2
    health_interval_s: float = 2.0
    replica_down_s: float = 5.0  # a replica that failed a call is skipped this long, then re-probed
    tokenize_workers: int = 2
    shutdown_grace_s: float = 30.0

    @property
    def pools(self) -> tuple[PoolSource, PoolSource, PoolSource]:
        return self.encoders, self.prefills, self.decodes

    @property
    def max_body_bytes(self) -> int:
        # Base64 images of the largest allowed prompt plus room for the text.
        return self.max_images_per_prompt * (self.image_limits.max_bytes * 4 // 3 + 4) + 16 * 1024 * 1024


class ConfigError(ValueError):
    """A flag value that cannot be used; the message says what to fix."""


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9][0-9_]*)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"{text!r} is not a size: use bytes or a number with KiB/MiB/GiB/KB/MB/GB")
    return int(match.group(1).replace("_", "")) * _SIZE_UNITS[match.group(2).lower()]


def parse_pool(pool: str, text: str) -> PoolSource:
    text = text.strip()
    if not text:
        raise ConfigError(f"--{pool}s is required: a comma-separated host:port list or dns:///name:port")
    if text.startswith("dns:///"):
        host, port = _host_port(pool, text.removeprefix("dns:///"))
        return PoolSource(pool, dns_name=host, dns_port=port)
    addresses = tuple(a.strip() for a in text.split(",") if a.strip())
    for address in addresses:
        _host_port(pool, address)
    return PoolSource(pool, addresses=tuple(dict.fromkeys(addresses)))


def _host_port(pool: str, address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--{pool}s: {address!r} is not host:port (e.g. 10.0.0.5:50051 or dns:///svc:50051)")
    return host, int(port)


# flag -> (default, help); every flag can also come from EPD_<FLAG>.
FLAGS: dict[str, tuple[str | None, str]] = {
    "checkpoint": (None, "checkpoint dir: tokenizer, chat template, processor config (no weights are read)"),
    "model-name": (None, "model id served and required in requests (default: the checkpoint dir name)"),
    "host": ("127.0.0.1", "address to bind"),
    "http-port": ("8000", "HTTP port (0 = any free port)"),
    "grpc-port": ("0", "gRPC Frontend port (0 = off)"),
    "ec-store": (None, "EC store URL (redis://... or a path): images already encoded are not sent again"),
    "encoders": ("", "encoder pool: host:port,... or dns:///name:port"),
    "prefills": ("", "prefill pool: host:port,... or dns:///name:port"),
    "decodes": ("", "decode pool: host:port,... or dns:///name:port"),
    "dns-refresh-s": ("10", "how often dns:/// pools are re-resolved"),
    "allow-http-image-urls": ("false", "fetch http(s) image URLs (off: only data: URLs and bytes)"),
    "image-fetch-timeout-s": ("30", "timeout for one http(s) image fetch"),
    "max-images-per-prompt": ("8", "images allowed in one request"),
    "max-image-bytes": ("20MiB", "largest image file accepted"),
    "max-image-pixels": ("50_000_000", "largest image accepted, width * height"),
    "max-model-len": (None, "context limit, prompt + max_tokens (default: max_position_embeddings)"),
    "default-max-tokens": ("256", "max_tokens when a request gives none"),
    "request-timeout-s": ("120", "deadline of one request, end to end; every RPC gets what is left"),
    "encode-retries": ("2", "extra Encode attempts after a failure, each on another replica"),
    "health-interval-s": ("2", "how often replicas are probed with grpc.health.v1"),
    "replica-down-s": ("5", "how long a replica that failed a call is skipped before it is re-probed"),
    "tokenize-workers": ("2", "threads that build prompts (chat template, tokenizer, image decode)"),
    "shutdown-grace-s": ("30", "on SIGTERM/SIGINT, how long in-flight requests may take to finish"),
}


def _flag_env(name: str) -> str:
    return "EPD_" + name.upper().replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.proxy",
        description="EPD proxy: OpenAI-compatible HTTP API and gRPC Frontend over the encoder, prefill and "
        "decode pools. Every flag can also be set as EPD_<FLAG>, e.g. EPD_HTTP_PORT=8000.",
    )
    for flag, (default, text) in FLAGS.items():
        suffix = f" [{_flag_env(flag)}; default {default}]" if default else f" [{_flag_env(flag)}]"
        if flag == "allow-http-image-urls":
            p.add_argument(f"--{flag}", action="store_const", const="true", help=text + suffix)
        else:
            p.add_argument(f"--{flag}", help=text + suffix)
    return p


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> ProxyConfig:
    """Flags over EPD_* environment over defaults. Raises ConfigError."""
    args = vars(build_parser().parse_args(argv))
    env = os.environ if env is None else env
    values = {}
    for flag, (default, _) in FLAGS.items():
        dest = flag.replace("-", "_")
        given = args[dest]
        values[dest] = given if given is not None else env.get(_flag_env(flag), default)
    return _validate(values)


def _validate(a: dict) -> ProxyConfig:
    checkpoint = _checkpoint(a["checkpoint"])
    limits = ImageLimits(
        max_bytes=_positive("max-image-bytes", parse_size(str(a["max_image_bytes"]))),
        max_pixels=_positive("max-image-pixels", _int("max-image-pixels", a["max_image_pixels"])),
    )
    model_len = _max_model_len(checkpoint, a["max_model_len"])
    return ProxyConfig(
        checkpoint=checkpoint,
        model_name=a["model_name"] or checkpoint.name,
        host=a["host"],
        http_port=_port("http-port", a["http_port"]),
        grpc_port=_port("grpc-port", a["grpc_port"]),
        ec_store=a["ec_store"] or None,
        encoders=parse_pool("encoder", a["encoders"]),
        prefills=parse_pool("prefill", a["prefills"]),
        decodes=parse_pool("decode", a["decodes"]),
        dns_refresh_s=_positive("dns-refresh-s", _float("dns-refresh-s", a["dns_refresh_s"])),
        allow_http_image_urls=_bool("allow-http-image-urls", a["allow_http_image_urls"]),
        image_fetch_timeout_s=_positive(
            "image-fetch-timeout-s", _float("image-fetch-timeout-s", a["image_fetch_timeout_s"])
        ),
        max_images_per_prompt=_positive(
            "max-images-per-prompt", _int("max-images-per-prompt", a["max_images_per_prompt"])
        ),
        image_limits=limits,
        max_model_len=_positive("max-model-len", model_len),
        default_max_tokens=_positive("default-max-tokens", _int("default-max-tokens", a["default_max_tokens"])),
        request_timeout_s=_positive("request-timeout-s", _float("request-timeout-s", a["request_timeout_s"])),
        encode_retries=_non_negative("encode-retries", _int("encode-retries", a["encode_retries"])),
        health_interval_s=_positive("health-interval-s", _float("health-interval-s", a["health_interval_s"])),
        replica_down_s=_non_negative("replica-down-s", _float("replica-down-s", a["replica_down_s"])),
        tokenize_workers=_positive("tokenize-workers", _int("tokenize-workers", a["tokenize_workers"])),
        shutdown_grace_s=_non_negative("shutdown-grace-s", _float("shutdown-grace-s", a["shutdown_grace_s"])),
    )


def _checkpoint(value: str | None) -> Path:
    if not value:
        raise ConfigError("--checkpoint is required: the model directory with config.json and tokenizer files")
    path = Path(value)
    if not (path / "config.json").is_file():
        raise ConfigError(f"--checkpoint {value}: no config.json there; point it at a Hugging Face model directory")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"--checkpoint {value}: no tokenizer files (tokenizer.json) there")
    if not (path / "preprocessor_config.json").is_file():
        raise ConfigError(f"--checkpoint {value}: no preprocessor_config.json (image processor settings) there")
    return path.resolve()


def _max_model_len(checkpoint: Path, flag_value: str | None) -> int:
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    limit = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
    if flag_value is None:
        if not limit:
            raise ConfigError(f"{checkpoint}/config.json has no max_position_embeddings: set --max-model-len")
        return int(limit)
    value = _int("max-model-len", flag_value)
    if limit and value > int(limit):
        raise ConfigError(f"--max-model-len {value} is over the model's max_position_embeddings ({limit})")
    return value


def _int(flag: str, value: object) -> int:
    try:
        return int(str(value).replace("_", ""))
    except ValueError:
        raise ConfigError(f"--{flag} must be an integer, got {value!r}") from None


def _float(flag: str, value: object) -> float:
    try:
        return float(str(value))
    except ValueError:
        raise ConfigError(f"--{flag} must be a number, got {value!r}") from None


def _bool(flag: str, value: object) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    if str(value).strip().lower() in _TRUE + _FALSE:
        return str(value).strip().lower() in _TRUE
    raise ConfigError(f"--{flag} (EPD_{flag.upper().replace('-', '_')}) must be true or false, got {value!r}")


def _port(flag: str, value: object) -> int:
    port = _int(flag, value)
    if not 0 <= port < 65536:
        raise ConfigError(f"--{flag} must be in 0..65535, got {port}")
    return port


def _positive(flag: str, value: int | float) -> int | float:
    if value <= 0:
        raise ConfigError(f"--{flag} must be > 0, got {value}")
    return value


def _non_negative(flag: str, value: int | float) -> int | float:
    if value < 0:
        raise ConfigError(f"--{flag} must be >= 0, got {value}")
    return value
