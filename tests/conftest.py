import io
import os

import numpy as np
import pytest
from PIL import Image

pytest_plugins = ["tests.conftest_redis"]

# Keep CPU tests single-threaded per process: 2-core CI machines, several processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A freshly written tiny Qwen2.5-VL checkpoint (random weights, local tokenizer)."""
    from services.models.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2_5_vl")


def make_image(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic picture with structure (gradients + noise), so its pixels matter."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], -1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8), "RGB")


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
