"""The model's own image processor (HF, PIL backend), plus pixel-free grid arithmetic."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
    smart_resize,
)

from services.multimodal.image_io import ImageInputError

SUPPORTED_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})


@dataclass(frozen=True)
class ProcessedImages:
    pixel_values: torch.Tensor  # float32 [total_patches, C * T * P * P], images concatenated
    grid_thw: torch.Tensor  # int64 [n_images, 3]
    patch_counts: tuple[int, ...]  # rows of pixel_values per image (= t * h * w)
    placeholder_counts: tuple[int, ...]  # image-pad tokens per image (= patches // merge**2)


class ImageProcessor:
    """Wraps `Qwen2VLImageProcessorPil`: the PIL backend is deterministic and needs no torchvision."""

    def __init__(self, hf_processor: Qwen2VLImageProcessorPil, model_type: str) -> None:
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"no image processor for model type {model_type!r}")
        self._hf = hf_processor
        self.model_type = model_type

    @classmethod
    def from_pretrained(cls, checkpoint_dir: str | os.PathLike) -> ImageProcessor:
        path = Path(checkpoint_dir)
        model_type = json.loads((path / "config.json").read_text(encoding="utf-8"))["model_type"]
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"no image processor for model type {model_type!r}")
        return cls(Qwen2VLImageProcessorPil.from_pretrained(str(path)), model_type)

    @property
    def hf_processor(self) -> Qwen2VLImageProcessorPil:
        return self._hf

    @property
    def merge_size(self) -> int:
        return int(self._hf.merge_size)

    @property
    def patch_size(self) -> int:
        return int(self._hf.patch_size)

    def preprocess(self, images: Sequence[Image.Image]) -> ProcessedImages:
        if not images:
            raise ValueError("preprocess needs at least one image")
        for image in images:
            self.grid_for_size(image.height, image.width)  # turns HF's aspect-ratio error into ours
        out = self._hf(list(images), return_tensors="pt")
        grid = out["image_grid_thw"].to(torch.int64)
        patches = tuple(int(n) for n in grid.prod(dim=-1).tolist())
        return ProcessedImages(
            pixel_values=out["pixel_values"].to(torch.float32),
            grid_thw=grid,
            patch_counts=patches,
            placeholder_counts=tuple(n // self.merge_size**2 for n in patches),
        )

    def grid_for_size(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) in patches for an image of this size, computed without pixels."""
        if height <= 0 or width <= 0:
            raise ImageInputError(f"image has zero size ({width}x{height})")
        size = self._hf.size
        try:
            resized_h, resized_w = smart_resize(
                height,
                width,
                factor=self.patch_size * self.merge_size,
                min_pixels=size.shortest_edge,
                max_pixels=size.longest_edge,
            )
        except ValueError as exc:  # aspect ratio over 200
            raise ImageInputError(f"image {width}x{height}: {exc}") from exc
        # A still image is one temporal patch (HF repeats the frame temporal_patch_size times).
        return 1, resized_h // self.patch_size, resized_w // self.patch_size

    def num_placeholder_tokens(self, height: int, width: int) -> int:
        t, h, w = self.grid_for_size(height, width)
        return t * h * w // self.merge_size**2

    def settings(self) -> dict[str, Any]:
        """Every processor setting that changes the pixels fed to the model, JSON-able."""
        hf = self._hf
        return {
            "model_type": self.model_type,
            "backend": "pil",
            "min_pixels": int(hf.size.shortest_edge),
            "max_pixels": int(hf.size.longest_edge),
            "patch_size": int(hf.patch_size),
            "merge_size": int(hf.merge_size),
            "temporal_patch_size": int(hf.temporal_patch_size),
            "image_mean": [float(v) for v in hf.image_mean],
            "image_std": [float(v) for v in hf.image_std],
            "rescale_factor": float(hf.rescale_factor),
            "resample": int(hf.resample),
            "do_resize": bool(hf.do_resize),
            "do_rescale": bool(hf.do_rescale),
            "do_normalize": bool(hf.do_normalize),
            "do_convert_rgb": bool(hf.do_convert_rgb),
        }
