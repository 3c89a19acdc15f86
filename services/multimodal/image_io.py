"""Image input: raw bytes / data URLs / local paths -> bytes -> bounded, decoded RGB image."""

from __future__ import annotations

import base64
import binascii
import functools
import io
import os
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

MiB = 1024 * 1024
# Raster formats clients actually send. Excludes e.g. EPS, whose loader shells out to Ghostscript.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG also opens MPO


class ImageInputError(ValueError):
    """A client-supplied image that cannot be accepted (bad source, undecodable, too large)."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * MiB
    max_pixels: int = 50_000_000


DEFAULT_LIMITS = ImageLimits()


def load_image_bytes(
    source: str | bytes | bytearray | memoryview, limits: ImageLimits = DEFAULT_LIMITS, allow_paths: bool = False
) -> bytes:
    """Encoded image bytes from raw bytes, a `data:image/...;base64,` URL or, when `allow_paths`
    (trusted callers only: never for client input), a local file path."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _check_size(bytes(source), limits)
    if not isinstance(source, str):
        raise ImageInputError(f"unsupported image source type {type(source).__name__}")
    lowered = source[:16].lower()
    if lowered.startswith("data:"):
        return _from_data_url(source, limits)
    if lowered.startswith(("http://", "https://")):
        raise ImageInputError(
            "remote image URLs (http/https) are disabled; "
            "send the image as a data:image/...;base64 URL or as raw bytes"
        )
    if "://" in source[:32] and not lowered.startswith("file://"):
        raise ImageInputError(f"unsupported image URL scheme: {source.split('://', 1)[0]!r}")
    if not allow_paths:
        raise ImageInputError("image must be a data:image/...;base64 URL (local file paths are not accepted)")
    return _from_path(source.removeprefix("file://"), limits)


def _check_size(data: bytes, limits: ImageLimits) -> bytes:
    if not data:
        raise ImageInputError("image data is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise ImageInputError(f"image is {len(data)} bytes, over the limit of {limits.max_bytes} bytes")
    return data


def _from_data_url(url: str, limits: ImageLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ImageInputError("malformed data URL: missing ',' between header and payload")
    params = header[len("data:") :].split(";")
    media_type = params[0].strip().lower()
    if not media_type.startswith("image/"):
        raise ImageInputError(f"data URL media type must be image/*, got {media_type or 'none'!r}")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise ImageInputError("data URL must be base64-encoded (';base64,')")
    payload = "".join(payload.split())
    # Reject before decoding: base64 expands 3 bytes into 4 characters.
    if len(payload) // 4 * 3 > limits.max_bytes + 2:
        raise ImageInputError(f"image is over the limit of {limits.max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageInputError(f"data URL payload is not valid base64: {exc}") from exc
    return _check_size(data, limits)


def _from_path(path_str: str, limits: ImageLimits) -> bytes:
    path = Path(path_str)
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise ImageInputError(f"cannot read image file {path_str!r}: {exc.strerror or exc}") from exc
    if not path.is_file():
        raise ImageInputError(f"image path {path_str!r} is not a regular file")
    if size > limits.max_bytes:
        raise ImageInputError(f"image is {size} bytes, over the limit of {limits.max_bytes} bytes")
    return _check_size(path.read_bytes(), limits)


def decode_image(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """Decode to RGB, checking byte and pixel limits before any pixel data is decoded."""
    _check_size(data, limits)
    try:
        image = Image.open(io.BytesIO(data), formats=_openable_formats())  # reads the header only
    except Image.DecompressionBombError as exc:
        # PIL's own hard limit (2x Image.MAX_IMAGE_PIXELS) fired before ours could.
        raise ImageInputError(f"image is over the pixel limit: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise ImageInputError("could not decode image data: unknown format or corrupt header") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageInputError(f"could not decode image data: {exc}") from exc
    _check_dimensions(image.size, limits)
    try:
        image.load()
    except Exception as exc:  # decoders raise assorted types on corrupt or truncated data
        raise ImageInputError(f"could not decode image data: {exc}") from exc
    return to_rgb(image)


@functools.cache
def _openable_formats() -> tuple[str, ...]:
    Image.init()  # a Pillow build without e.g. libwebp has no WEBP opener; asking for it raises
    return tuple(f for f in ALLOWED_FORMATS if f in Image.OPEN)


def _check_dimensions(size: tuple[int, int], limits: ImageLimits) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageInputError(f"image has zero size ({width}x{height})")
    if width * height > limits.max_pixels:
        raise ImageInputError(
            f"image is {width}x{height} = {width * height} pixels, "
            f"over the pixel limit of {limits.max_pixels} pixels"
        )


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB the way transformers' convert_to_rgb does it: transparency composited onto white."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
