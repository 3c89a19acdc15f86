"""Prompt building off the event loop: chat template, tokenizer, image decode and content keys.

Each worker thread has its own PromptBuilder: a fast tokenizer must not be used by two
threads at once. The event-loop thread has one more tokenizer, for detokenizing.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jinja2 import TemplateError

from services.engine.sequence import RequestError
from services.models.checkpoint import vision_identity
from services.multimodal.image_io import ImageInputError, ImageLimits
from services.multimodal.processor import ImageProcessor
from services.multimodal.prompt import ChatPrompt, PromptBuilder
from services.proxy.errors import InvalidRequest


def model_identity(checkpoint: Path) -> str:
    """The content-key model id, from config.json alone (the proxy needs no weight files)."""
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    return vision_identity(config)


class PromptWorkers:
    def __init__(self, checkpoint: Path, limits: ImageLimits, max_images: int, workers: int) -> None:
        self.checkpoint = checkpoint
        self.limits = limits
        self.max_images = max_images
        self.processor = ImageProcessor.from_pretrained(checkpoint)
        self.model_id = model_identity(checkpoint)
        self.tokenizer = self._new_builder().tokenizer  # event-loop thread only
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="epd-prompt")

    async def build(self, messages: Sequence[Mapping]) -> ChatPrompt:
        """Raises InvalidRequest with PromptBuilder's message (what to fix)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._build, messages)

    def _build(self, messages: Sequence[Mapping]) -> ChatPrompt:
        builder = getattr(self._local, "builder", None)
        if builder is None:
            builder = self._local.builder = self._new_builder()
        try:
            return builder.build(messages)
        except (RequestError, ImageInputError) as exc:
            raise InvalidRequest(str(exc), "messages") from None
        except TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", "messages") from None

    def _new_builder(self) -> PromptBuilder:
        return PromptBuilder(self.checkpoint, self.processor, self.model_id, self.limits, self.max_images)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
