"""A chat request as the pipeline sees it, and what the pipeline yields for it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SamplingDefaults:
    """Used when a request leaves a parameter out: the checkpoint's generation_config.json,
    else OpenAI's defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def from_checkpoint(cls, checkpoint: Path) -> SamplingDefaults:
        path = checkpoint / "generation_config.json"
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        base = cls()
        return cls(
            temperature=float(config.get("temperature", base.temperature)),
            top_p=float(config.get("top_p", base.top_p)),
            top_k=max(0, int(config.get("top_k", base.top_k) or 0)),
        )


@dataclass(frozen=True)
class ChatRequest:
    # role + content; content is a str or a list of {"type": "text", "text"} and
    # {"type": "image_url", "image_url": {"url": data URL | http(s) URL | bytes}} parts.
    messages: list[dict]
    max_tokens: int | None  # None: the default, capped by what the context leaves
    temperature: float
    top_p: float
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    num_images: int = 0


@dataclass
class Output:
    """New text and tokens since the previous Output; the last one has finish_reason set."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far
