"""Encoder-cache (EC) connector: encoder pool -> shared store -> prefill pool."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from connectors.ec.base import (
    ECConsumer,
    ECCorruptEntryError,
    ECEntry,
    ECError,
    ECProducer,
    ECStats,
    ECStore,
    ECTimeoutError,
    validate_key,
)
from connectors.ec.codec import decode_entry, encode_entry
from connectors.ec.filesystem import FilesystemECStore
from connectors.ec.redis_store import RedisECStore

__all__ = [
    "ECConsumer",
    "ECCorruptEntryError",
    "ECEntry",
    "ECError",
    "ECProducer",
    "ECStats",
    "ECStore",
    "ECTimeoutError",
    "FilesystemECStore",
    "RedisECStore",
    "decode_entry",
    "encode_entry",
    "open_ec_store",
    "validate_key",
]

_REDIS_SCHEMES = ("redis", "rediss", "unix")


def _open_filesystem(path: str, max_bytes: int | None = None, ttl_s: int | None = None) -> FilesystemECStore:
    if max_bytes is None:
        raise ValueError("the filesystem EC store needs max_bytes")
    if ttl_s is not None:
        raise ValueError("ttl_s is not supported by the filesystem EC store")
    return FilesystemECStore(Path(path), max_bytes=max_bytes)


def open_ec_store(url: str, **kw) -> ECStore:
    """Open a store from a URL.

    file:///abs/path or a plain path -> FilesystemECStore (needs max_bytes);
    redis://host:port/db (also rediss://, unix://) -> RedisECStore (ttl_s, max_bytes, prefix).
    """
    scheme = urlparse(url).scheme
    if scheme in _REDIS_SCHEMES:
        return RedisECStore(url, **kw)
    if scheme == "file":
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URL must be local (file:///abs/path), got {url!r}")
        return _open_filesystem(unquote(parsed.path), **kw)
    if scheme == "":
        return _open_filesystem(url, **kw)
    raise ValueError(f"unsupported EC store URL {url!r}: use file:///path, a plain path, or redis://")
