"""EC entry wire format, shared by all backends.

    MAGIC | u32 little-endian header length | UTF-8 JSON header | raw tensor bytes

Header: {"shape": [rows, width], "dtype": "bfloat16", "width": W, "nbytes": N,
"blake3": "<hex of payload>", "meta": {str: str}}. The payload is the tensor's
C-contiguous little-endian bytes (bf16 goes through a uint8 view; numpy has no bf16).
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Mapping

import numpy as np
import torch
from blake3 import blake3

from connectors.ec.base import ECCorruptEntryError, ECEntry

MAGIC = b"EPDEC1\n"
MAX_HEADER_BYTES = 64 * 1024
_HLEN = struct.Struct("<I")
_PREFIX_LEN = len(MAGIC) + _HLEN.size

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise NotImplementedError("EC codec assumes a little-endian host")


def payload_nbytes(tensor: torch.Tensor) -> int:
    """Validate tensor for storage and return its payload size (no copy is made)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"EC entry must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 2:
        raise ValueError(f"EC entry must be 2-D [rows, width], got shape {tuple(tensor.shape)}")
    if tensor.dtype not in _DTYPE_NAMES:
        raise ValueError(f"EC entry dtype {tensor.dtype} unsupported; use one of {sorted(DTYPES)}")
    return tensor.numel() * tensor.element_size()


def _check_meta(meta: Mapping[str, str] | None) -> dict[str, str]:
    meta = dict(meta or {})
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"EC meta must map str -> str, got {k!r}: {v!r}")
    return meta


def _hash(payload: memoryview | bytes) -> str:
    return blake3(payload, max_threads=blake3.AUTO).hexdigest()


def encode_parts(tensor: torch.Tensor, meta: Mapping[str, str] | None = None) -> tuple[bytes, memoryview]:
    """(prefix incl. header, payload view); their concatenation is the encoded entry."""
    _require_little_endian()
    nbytes = payload_nbytes(tensor)
    t = tensor.detach().to("cpu").contiguous()
    payload = memoryview(t.view(torch.uint8).numpy()).cast("B") if nbytes else memoryview(b"")
    header = {
        "shape": [int(s) for s in t.shape],
        "dtype": _DTYPE_NAMES[t.dtype],
        "width": int(t.shape[1]),
        "nbytes": nbytes,
        "blake3": _hash(payload),
        "meta": _check_meta(meta),
    }
    hbytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    if len(hbytes) > MAX_HEADER_BYTES:
        raise ValueError(f"EC header is {len(hbytes)} bytes (max {MAX_HEADER_BYTES}); meta too large")
    return MAGIC + _HLEN.pack(len(hbytes)) + hbytes, payload


def encode_entry(tensor: torch.Tensor, meta: Mapping[str, str] | None = None) -> bytes:
    prefix, payload = encode_parts(tensor, meta)
    return b"".join((prefix, payload))


def _corrupt(msg: str) -> ECCorruptEntryError:
    return ECCorruptEntryError(f"corrupt EC entry: {msg}")


def _parse_header(buf: memoryview) -> tuple[dict, memoryview]:
    if len(buf) < _PREFIX_LEN:
        raise _corrupt(f"only {len(buf)} bytes, shorter than the {_PREFIX_LEN}-byte prefix")
    if bytes(buf[: len(MAGIC)]) != MAGIC:
        raise _corrupt(f"bad magic {bytes(buf[: len(MAGIC)])!r}, expected {MAGIC!r}")
    (hlen,) = _HLEN.unpack(buf[len(MAGIC) : _PREFIX_LEN])
    if hlen > MAX_HEADER_BYTES or _PREFIX_LEN + hlen > len(buf):
        raise _corrupt(f"header length {hlen} exceeds limit or buffer ({len(buf)} bytes)")
    try:
        header = json.loads(bytes(buf[_PREFIX_LEN : _PREFIX_LEN + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(f"header is not valid UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise _corrupt("header is not a JSON object")
    return header, buf[_PREFIX_LEN + hlen :]


def _check_header(h: dict, payload_len: int) -> tuple[torch.dtype, tuple[int, int]]:
    name = h.get("dtype")
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise _corrupt(f"unknown dtype {h.get('dtype')!r}")
    shape = h.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(s) is int and s >= 0 for s in shape)):
        raise _corrupt(f"shape {shape!r} is not [rows, width]")
    if h.get("width") != shape[1]:
        raise _corrupt(f"width {h.get('width')!r} != shape[1] {shape[1]}")
    expect = shape[0] * shape[1] * dtype.itemsize
    if h.get("nbytes") != expect:
        raise _corrupt(f"nbytes {h.get('nbytes')!r} != shape {shape} x itemsize {dtype.itemsize} = {expect}")
    if payload_len != expect:
        raise _corrupt(f"payload is {payload_len} bytes, header says {expect} (truncated?)")
    meta = h.get("meta")
    if not (isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise _corrupt("meta is not a str -> str object")
    if not isinstance(h.get("blake3"), str):
        raise _corrupt("missing blake3 digest")
    return dtype, (shape[0], shape[1])


def decode_entry(buf: bytes | bytearray | memoryview) -> ECEntry:
    """Parse and verify an encoded entry; ECCorruptEntryError on any mismatch."""
    _require_little_endian()
    header, payload = _parse_header(memoryview(buf).cast("B"))
    dtype, shape = _check_header(header, len(payload))
    digest = _hash(payload)
    if digest != header["blake3"]:
        raise _corrupt(f"payload blake3 {digest[:16]}... != header {header['blake3'][:16]}...")
    raw = torch.empty(len(payload), dtype=torch.uint8)  # own copy: tensor must not alias buf
    raw.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
    return ECEntry(tensor=raw.view(dtype).reshape(shape), meta=dict(header["meta"]))
