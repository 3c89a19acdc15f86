"""Encoder stage: images -> the model's image processor -> vision tower -> EC store.

Holds only the vision tower. Items are batched under a patch budget and never
split; an item already in the store is not encoded again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from connectors.ec import ECStore
from services.models.checkpoint import Checkpoint, open_checkpoint, vision_identity
from services.models.registry import load_vision_tower
from services.multimodal.content_key import content_key
from services.multimodal.processor import ImageProcessor


@dataclass(frozen=True)
class EncodedItem:
    key: str
    embeddings: torch.Tensor  # [rows, width] on CPU
    grid_thw: tuple[int, int, int]


@dataclass(frozen=True)
class ItemMeta:
    """What the encoder reports per item: enough for a prefill spec."""

    key: str
    rows: int
    width: int
    dtype: str
    grid_thw: tuple[int, int, int]
    cached: bool  # True if the store already had it and nothing was encoded


class EncoderStage:
    def __init__(
        self,
        checkpoint: str | Path | Checkpoint,
        store: ECStore | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_patches: int = 16384,
    ) -> None:
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
        self.store = store
        self.device = torch.device(device)
        self.max_batch_patches = max_batch_patches
        self.processor = ImageProcessor.from_pretrained(ckpt.root)
        self.model_id = vision_identity(ckpt.config)
        self.tower = load_vision_tower(ckpt, self.device, dtype)

    def key_for(self, image: Image.Image) -> str:
        return content_key(image, self.model_id, self.processor.settings())

    def encode(self, images: Sequence[Image.Image]) -> list[EncodedItem]:
        """Encode every image; several per forward, each whole."""
        return [EncodedItem(self.key_for(im), rows, grid) for im, (rows, grid) in zip(images, self._forward(images))]

    def encode_and_publish(self, images: Sequence[Image.Image]) -> list[ItemMeta]:
        """Encode the images whose keys are not in the store yet and publish them."""
        assert self.store is not None, "encode_and_publish needs an EC store"
        keys = [self.key_for(image) for image in images]
        todo = [i for i, key in enumerate(keys) if not self.store.exists(key)]
        encoded = dict(zip(todo, self._forward([images[i] for i in todo])))
        metas = []
        for i, (image, key) in enumerate(zip(images, keys)):
            if i not in encoded:
                metas.append(self.cached_meta(key, image))
                continue
            rows, grid = encoded[i]
            metas.append(self.publish(EncodedItem(key, rows, grid)))
        return metas

    def encode_keyed(self, keys: Sequence[str], images: Sequence[Image.Image]) -> list[EncodedItem]:
        """Like `encode`, for images whose content keys the caller has already computed."""
        return [EncodedItem(key, rows, grid) for key, (rows, grid) in zip(keys, self._forward(images))]

    def publish(self, item: EncodedItem) -> ItemMeta:
        """Put an encoded item in the store (a no-op if another encoder got there first)."""
        assert self.store is not None, "publish needs an EC store"
        rows = item.embeddings
        self.store.put(item.key, rows, {"grid_thw": ",".join(map(str, item.grid_thw)), "model": self.model_id})
        return ItemMeta(item.key, rows.shape[0], rows.shape[1], _dtype_name(rows.dtype), item.grid_thw, cached=False)

    def patches(self, image: Image.Image) -> int:
        """Vision patches the image becomes (what the batch budget counts)."""
        t, h, w = self.processor.grid_for_size(image.height, image.width)
        return t * h * w

    @torch.inference_mode()
    def _forward(self, images: Sequence[Image.Image]) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        out = []
        for batch in self._batches(images):
            processed = self.processor.preprocess(batch)
            grids = [tuple(int(v) for v in g) for g in processed.grid_thw.tolist()]
            embeddings = self.tower(processed.pixel_values.to(self.device, non_blocking=True), grids)
            out.extend((rows.cpu(), grid) for rows, grid in zip(embeddings, grids))
        return out

    def cached_meta(self, key: str, image: Image.Image) -> ItemMeta:
        """The meta of an item already in the store, computed without pixels."""
        grid = self.processor.grid_for_size(image.height, image.width)
        rows = self.processor.num_placeholder_tokens(image.height, image.width)
        dtype = _dtype_name(self.tower.merger.mlp[2].weight.dtype)
        return ItemMeta(key, rows, self.tower.output_width, dtype, grid, cached=True)

    def _batches(self, images: Sequence[Image.Image]) -> list[list[Image.Image]]:
        batches: list[list[Image.Image]] = [[]]
        used = 0
        for image in images:
            patches = self.patches(image)
            if batches[-1] and used + patches > self.max_batch_patches:
                batches.append([])
                used = 0
            batches[-1].append(image)
            used += patches
        return [b for b in batches if b]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
