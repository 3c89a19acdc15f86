"""Content keys: blake3 over a canonical, self-describing serialization of decoded pixels.

Layout (every variable-length field is length-prefixed, integers are 8-byte little-endian):
  VERSION | model id (UTF-8) | processor settings (canonical JSON)
  | b"image" | PIL mode | numpy dtype | ndim, dims... | raw pixel bytes (C order)
Keys depend on decoded pixels, not the file encoding: a PNG and a lossless BMP of the
same picture share a key; the same bytes under another shape, model or setting do not.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
from blake3 import blake3
from PIL import Image

VERSION = b"epd-content-key/v1"
IMAGE_TAG = b"image"


def canonical_json(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def _field(data: bytes) -> bytes:
    return _u64(len(data)) + data


def pixel_array_key(array: np.ndarray, mode: str, model_id: str, processor_settings: Mapping[str, Any]) -> str:
    # Little-endian, C-contiguous: equal pixel values always serialize to equal bytes.
    arr = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    hasher = blake3()
    hasher.update(_field(VERSION))
    hasher.update(_field(model_id.encode("utf-8")))
    hasher.update(_field(canonical_json(processor_settings)))
    hasher.update(_field(IMAGE_TAG))
    hasher.update(_field(mode.encode("utf-8")))
    hasher.update(_field(arr.dtype.str.encode("ascii")))
    hasher.update(_u64(arr.ndim) + b"".join(_u64(d) for d in arr.shape))
    hasher.update(_u64(arr.nbytes))
    hasher.update(memoryview(arr.reshape(-1).view(np.uint8)))  # no copy of large images
    return hasher.hexdigest()


def content_key(image: Image.Image, model_id: str, processor_settings: Mapping[str, Any]) -> str:
    return pixel_array_key(np.asarray(image), image.mode, model_id, processor_settings)
