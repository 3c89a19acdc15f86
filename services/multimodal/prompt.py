"""Chat messages -> token ids with one placeholder per embedding row, plus feature specs.

The chat template puts one `<|image_pad|>` per image; it is expanded to as many
placeholders as the encoder will produce rows for that image, computed from the
image size alone (no pixels are processed here).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image
from transformers import AutoTokenizer

from services.engine.sequence import FeatureSpec, RequestError
from services.multimodal.content_key import content_key
from services.multimodal.image_io import DEFAULT_LIMITS, ImageLimits, decode_image, load_image_bytes
from services.multimodal.processor import ImageProcessor

IMAGE_PAD = "<|image_pad|>"


@dataclass(frozen=True)
class ChatPrompt:
    token_ids: list[int]
    features: list[FeatureSpec]  # in prompt order
    images: list[Image.Image]  # decoded, same order as features
    image_files: list[bytes]  # the encoded image bytes, as an encoder receives them


class PromptBuilder:
    def __init__(
        self,
        checkpoint_dir: str | Path,
        processor: ImageProcessor,
        model_id: str,
        limits: ImageLimits = DEFAULT_LIMITS,
        max_images: int | None = None,
    ) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir))
        self.processor = processor
        self.model_id = model_id
        self.limits = limits
        self.max_images = max_images
        self.image_pad_id = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)

    def build(self, messages: Sequence[Mapping]) -> ChatPrompt:
        template_messages, files = self._split_images(messages)
        if self.max_images is not None and len(files) > self.max_images:
            raise RequestError(f"the prompt has {len(files)} images; at most {self.max_images} are allowed per prompt")
        images = [decode_image(data, self.limits) for data in files]
        text = self.tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self._expand(ids, images, files)

    def _expand(self, ids: list[int], images: list[Image.Image], files: list[bytes]) -> ChatPrompt:
        pads = [i for i, t in enumerate(ids) if t == self.image_pad_id]
        if len(pads) != len(images):
            raise RequestError(f"the prompt text contains {len(pads) - len(images)} stray {IMAGE_PAD} tokens")
        out: list[int] = []
        features: list[FeatureSpec] = []
        cursor = 0
        settings = self.processor.settings()
        for pad, image in zip(pads, images):
            out.extend(ids[cursor:pad])
            grid = self.processor.grid_for_size(image.height, image.width)
            rows = self.processor.num_placeholder_tokens(image.height, image.width)
            features.append(FeatureSpec(content_key(image, self.model_id, settings), len(out), rows, grid))
            out.extend([self.image_pad_id] * rows)
            cursor = pad + 1
        out.extend(ids[cursor:])
        return ChatPrompt(out, features, images, files)

    def _split_images(self, messages: Sequence[Mapping]) -> tuple[list[dict], list[bytes]]:
        """Messages for the template (image parts reduced to a marker) and the image files."""
        if not messages:
            raise RequestError("messages must be a non-empty list")
        template, images = [], []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str):
                template.append({"role": message["role"], "content": content})
                continue
            if not isinstance(content, list):
                raise RequestError("message content must be a string or a list of parts")
            parts = []
            for part in content:
                kind = part.get("type")
                if kind == "text":
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in ("image_url", "image"):
                    images.append(self._image_of(part))
                    parts.append({"type": "image"})
                else:
                    raise RequestError(f"unsupported content part type {kind!r}; use 'text' or 'image_url'")
            template.append({"role": message["role"], "content": parts})
        return template, images

    def _image_of(self, part: Mapping) -> bytes:
        if part.get("type") == "image_url":
            url = part.get("image_url")
            source = url.get("url") if isinstance(url, Mapping) else url
        else:
            source = part.get("image")
        if isinstance(source, Image.Image):
            buf = io.BytesIO()
            source.save(buf, format="PNG")
            return buf.getvalue()
        if source is None:
            raise RequestError("an image part has no image data or url")
        return load_image_bytes(source, self.limits)
