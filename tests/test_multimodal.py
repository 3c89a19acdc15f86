"""Image input, the model's image processor, and content keys."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from services.models.tiny_checkpoint import SPEC, preprocessor_config
from services.multimodal.content_key import content_key, pixel_array_key
from services.multimodal.image_io import (
    ImageInputError,
    ImageLimits,
    decode_image,
    load_image_bytes,
)
from services.multimodal.processor import ImageProcessor

MODEL_ID = "tiny-qwen2_5_vl"


def _write_processor_dir(path: Path, **overrides) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    cfg = preprocessor_config(SPEC) | overrides
    if "max_pixels" in overrides:
        cfg["size"] = {"shortest_edge": cfg["min_pixels"], "longest_edge": cfg["max_pixels"]}
    (path / "preprocessor_config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory) -> ImageProcessor:
    return ImageProcessor.from_pretrained(_write_processor_dir(tmp_path_factory.mktemp("proc")))


def _picture(height: int = 37, width: int = 53, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _encode(array: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims the given size (no real pixel data)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


# --- image_io -------------------------------------------------------------------------------


def test_sources_give_the_same_bytes(tmp_path: Path) -> None:
    png = _encode(_picture(), "PNG")
    path = tmp_path / "pic.png"
    path.write_bytes(png)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert load_image_bytes(png) == load_image_bytes(str(path), allow_paths=True) == load_image_bytes(url) == png
    assert load_image_bytes(f"file://{path}", allow_paths=True) == png
    with pytest.raises(ImageInputError, match="local file paths are not accepted"):
        load_image_bytes(str(path))
    assert load_image_bytes(bytearray(png)) == png


def test_decode_gives_rgb_pixels() -> None:
    pixels = _picture()
    image = decode_image(_encode(pixels, "PNG"))
    assert image.mode == "RGB" and image.size == (53, 37)
    assert np.array_equal(np.asarray(image), pixels)


def test_transparency_is_composited_onto_white() -> None:
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[..., 0] = 200  # fully transparent red
    image = decode_image(_encode(rgba, "PNG"))
    assert image.mode == "RGB"
    assert np.all(np.asarray(image) == 255)


def test_grayscale_becomes_rgb() -> None:
    gray = np.arange(64, dtype=np.uint8).reshape(8, 8)
    image = decode_image(_encode(gray, "PNG"))
    assert image.mode == "RGB"
    assert np.array_equal(np.asarray(image)[..., 1], gray)


def test_garbage_bytes_are_rejected() -> None:
    with pytest.raises(ImageInputError, match="could not decode image data"):
        decode_image(b"definitely not an image")


def test_truncated_image_is_rejected() -> None:
    png = _encode(_picture(64, 64), "PNG")
    with pytest.raises(ImageInputError, match="could not decode image data"):
        decode_image(png[: len(png) // 2])


def test_empty_bytes_are_rejected() -> None:
    with pytest.raises(ImageInputError, match="empty"):
        decode_image(b"")


def test_over_byte_limit() -> None:
    png = _encode(_picture(), "PNG")
    limits = ImageLimits(max_bytes=len(png) - 1)
    with pytest.raises(ImageInputError, match=rf"{len(png)} bytes, over the limit of {len(png) - 1} bytes"):
        decode_image(png, limits)
    with pytest.raises(ImageInputError, match="over the limit"):
        load_image_bytes(png, limits)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    with pytest.raises(ImageInputError, match="over the limit"):
        load_image_bytes(url, ImageLimits(max_bytes=len(png) // 2))


def test_over_byte_limit_file_not_read(tmp_path: Path) -> None:
    path = tmp_path / "big.png"
    path.write_bytes(b"\0" * 1000)
    with pytest.raises(ImageInputError, match="1000 bytes, over the limit of 999 bytes"):
        load_image_bytes(str(path), ImageLimits(max_bytes=999), allow_paths=True)


def test_over_pixel_limit() -> None:
    png = _encode(_picture(100, 100), "PNG")
    with pytest.raises(ImageInputError, match=r"100x100 = 10000 pixels, over the pixel limit of 9999"):
        decode_image(png, ImageLimits(max_pixels=9999))
    assert decode_image(png, ImageLimits(max_pixels=10000)).size == (100, 100)


def test_decompression_bomb_is_rejected_from_header() -> None:
    # The headers claim 8000x8000 and 100000x100000 pixels; nothing may be decoded.
    with pytest.raises(ImageInputError, match="8000x8000 = 64000000 pixels, over the pixel limit"):
        decode_image(_png_header(8000, 8000))
    with pytest.raises(ImageInputError, match="over the pixel limit"):
        decode_image(_png_header(100_000, 100_000))


def test_http_urls_are_disabled() -> None:
    for url in ("http://example.com/a.png", "HTTPS://example.com/a.png"):
        with pytest.raises(ImageInputError, match=r"remote image URLs \(http/https\) are disabled"):
            load_image_bytes(url)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("ftp://host/a.png", "unsupported image URL scheme"),
        ("data:text/plain;base64,aGk=", "media type must be image/"),
        ("data:image/png,rawdata", "must be base64"),
        ("data:image/png;base64", "missing ','"),
        ("data:image/png;base64,!!!", "not valid base64"),
        ("data:image/png;base64,", "empty"),
        ("/no/such/file.png", "cannot read image file"),
    ],
)
def test_bad_sources(source: str, message: str) -> None:
    with pytest.raises(ImageInputError, match=message):
        load_image_bytes(source, allow_paths=True)


def test_image_input_error_is_value_error() -> None:
    assert issubclass(ImageInputError, ValueError)


# --- processor ------------------------------------------------------------------------------

SIZES = [
    (1, 1),
    (13, 7),
    (28, 28),
    (56, 56),
    (100, 300),
    (224, 224),
    (333, 500),
    (480, 640),
    (1080, 1920),
    (3000, 4000),
    (4000, 3000),
    (20, 3000),
    (3000, 20),
    (15, 2999),
    (2999, 15),
    (29, 5000),
    (5000, 29),
    (57, 4001),
    (317, 316),
    (10, 10),
    (55, 57),
    (641, 479),
]


def _random_sizes(n: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(7)
    sizes = []
    while len(sizes) < n:
        h, w = (int(v) for v in rng.integers(1, 2500, 2))
        if max(h, w) / min(h, w) < 200:
            sizes.append((h, w))
    return sizes


@pytest.mark.parametrize(("height", "width"), SIZES + _random_sizes(20))
def test_grid_for_size_matches_hf(processor: ImageProcessor, height: int, width: int) -> None:
    image = Image.new("RGB", (width, height), (10, 20, 30))
    hf = processor.hf_processor(image, return_tensors="pt")
    t, h, w = processor.grid_for_size(height, width)
    assert hf["image_grid_thw"].tolist() == [[t, h, w]]
    assert hf["pixel_values"].shape[0] == t * h * w
    assert processor.num_placeholder_tokens(height, width) == t * h * w // 4


def test_preprocess_matches_hf_exactly(processor: ImageProcessor) -> None:
    images = [Image.fromarray(_picture(60, 200, seed=1)), Image.fromarray(_picture(300, 90, seed=2))]
    out = processor.preprocess(images)
    ref = Qwen2VLImageProcessorPil(**preprocessor_config(SPEC))(images, return_tensors="pt")
    assert out.pixel_values.dtype == torch.float32
    assert out.grid_thw.dtype == torch.int64
    assert torch.equal(out.pixel_values, ref["pixel_values"])
    assert torch.equal(out.grid_thw, ref["image_grid_thw"])
    assert out.pixel_values.shape[1] == 3 * 2 * 14 * 14
    assert out.patch_counts == tuple(int(t * h * w) for t, h, w in out.grid_thw.tolist())
    assert sum(out.patch_counts) == out.pixel_values.shape[0]
    assert out.placeholder_counts == tuple(n // 4 for n in out.patch_counts)
    for image, grid in zip(images, out.grid_thw.tolist()):
        assert processor.grid_for_size(image.height, image.width) == tuple(grid)


def test_extreme_aspect_ratio_is_an_input_error(processor: ImageProcessor) -> None:
    with pytest.raises(ImageInputError, match="aspect ratio"):
        processor.grid_for_size(10, 2500)
    with pytest.raises(ImageInputError, match="zero size"):
        processor.grid_for_size(0, 10)


def test_settings_are_canonical_json(processor: ImageProcessor) -> None:
    settings = processor.settings()
    assert json.loads(json.dumps(settings)) == settings
    assert settings["min_pixels"] == 3136 and settings["max_pixels"] == 100352
    assert settings["patch_size"] == 14 and settings["merge_size"] == 2
    assert settings["resample"] == 3 and settings["rescale_factor"] == pytest.approx(1 / 255)


def test_rejects_unknown_model_type(tmp_path: Path) -> None:
    path = _write_processor_dir(tmp_path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="llama"):
        ImageProcessor.from_pretrained(path)


# --- content keys ---------------------------------------------------------------------------


def _key_from_source(source: str | bytes, settings: dict) -> str:
    return content_key(decode_image(load_image_bytes(source, allow_paths=True)), MODEL_ID, settings)


def test_png_file_and_data_url_share_a_key(processor: ImageProcessor, tmp_path: Path) -> None:
    png = _encode(_picture(), "PNG")
    path = tmp_path / "pic.png"
    path.write_bytes(png)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    settings = processor.settings()
    assert _key_from_source(str(path), settings) == _key_from_source(url, settings)
    assert len(_key_from_source(png, settings)) == 64


def test_lossless_reencodings_share_a_key(processor: ImageProcessor) -> None:
    pixels = _picture()
    settings = processor.settings()
    keys = {_key_from_source(_encode(pixels, fmt), settings) for fmt in ("PNG", "BMP", "TIFF")}
    assert len(keys) == 1


def test_different_pixels_give_different_keys(processor: ImageProcessor) -> None:
    settings = processor.settings()
    a, b = _picture(seed=0), _picture(seed=0)
    b[0, 0, 0] ^= 1
    assert pixel_array_key(a, "RGB", MODEL_ID, settings) != pixel_array_key(b, "RGB", MODEL_ID, settings)


def test_same_buffer_other_shape_gives_other_key(processor: ImageProcessor) -> None:
    settings = processor.settings()
    pixels = _picture(20, 30)
    transposed_shape = pixels.reshape(30, 20, 3)  # same bytes, (W, H, 3)
    assert pixels.tobytes() == transposed_shape.tobytes()
    assert pixel_array_key(pixels, "RGB", MODEL_ID, settings) != pixel_array_key(
        transposed_shape, "RGB", MODEL_ID, settings
    )


def test_mode_and_dtype_are_part_of_the_key(processor: ImageProcessor) -> None:
    settings = processor.settings()
    pixels = _picture(4, 4)
    base = pixel_array_key(pixels, "RGB", MODEL_ID, settings)
    assert pixel_array_key(pixels, "YCbCr", MODEL_ID, settings) != base
    assert pixel_array_key(pixels.view(np.int8), "RGB", MODEL_ID, settings) != base


def test_key_ignores_memory_layout(processor: ImageProcessor) -> None:
    settings = processor.settings()
    pixels = _picture(12, 9)
    fortran = np.asfortranarray(pixels)
    assert pixel_array_key(fortran, "RGB", MODEL_ID, settings) == pixel_array_key(pixels, "RGB", MODEL_ID, settings)


def test_processor_settings_change_the_key(processor: ImageProcessor, tmp_path: Path) -> None:
    other = ImageProcessor.from_pretrained(_write_processor_dir(tmp_path, max_pixels=28 * 28 * 256))
    assert other.settings()["max_pixels"] == 28 * 28 * 256
    image = Image.fromarray(_picture())
    assert content_key(image, MODEL_ID, processor.settings()) != content_key(image, MODEL_ID, other.settings())


def test_settings_key_order_does_not_matter(processor: ImageProcessor) -> None:
    settings = processor.settings()
    reordered = dict(reversed(list(settings.items())))
    image = Image.fromarray(_picture())
    assert content_key(image, MODEL_ID, settings) == content_key(image, MODEL_ID, reordered)


def test_model_id_changes_the_key(processor: ImageProcessor) -> None:
    image = Image.fromarray(_picture())
    settings = processor.settings()
    assert content_key(image, MODEL_ID, settings) != content_key(image, MODEL_ID + "-v2", settings)
