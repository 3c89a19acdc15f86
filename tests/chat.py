"""OpenAI chat-message helpers for tests: data URLs, image parts, user messages."""

from __future__ import annotations

import base64


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def user(*parts) -> list[dict]:
    """One user message: a plain string, or content parts (strings become text parts)."""
    if len(parts) == 1 and isinstance(parts[0], str):
        return [{"role": "user", "content": parts[0]}]
    return [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}]
