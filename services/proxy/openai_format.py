"""OpenAI chat-completions wire format: request parsing and validation, response builders."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.proxy.errors import InvalidRequest
from services.proxy.request import ChatRequest, Output, SamplingDefaults

ROLES = ("system", "user", "assistant")
_U64 = 2**64
# Parameters this server cannot honour: rejected unless they hold their neutral value.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
}


@dataclass(frozen=True)
class RequestParser:
    model_name: str
    max_images: int
    allow_http_images: bool
    defaults: SamplingDefaults = SamplingDefaults()

    def parse(self, body: object) -> ChatRequest:
        if not isinstance(body, Mapping):
            raise InvalidRequest("the request body must be a JSON object", None)
        self._check_model(body.get("model"))
        self._check_unsupported(body)
        messages, num_images = self._messages(body.get("messages"))
        stream = _bool(body, "stream", False)
        return ChatRequest(
            messages=messages,
            max_tokens=_max_tokens(body),
            temperature=_number(body, "temperature", self.defaults.temperature, 0.0, 2.0, "[0, 2]"),
            top_p=_top_p(body, self.defaults.top_p),
            top_k=_top_k(body, self.defaults.top_k),
            seed=_seed(body),
            stop=_stop(body),
            stop_token_ids=_stop_token_ids(body),
            ignore_eos=_bool(body, "ignore_eos", False),
            stream=stream,
            include_usage=_include_usage(body, stream),
            num_images=num_images,
        )

    def _check_model(self, model: object) -> None:
        if not isinstance(model, str) or not model:
            raise InvalidRequest(f"model is required: use {self.model_name!r} (see GET /v1/models)", "model")
        if model != self.model_name:
            raise InvalidRequest(
                f"model {model!r} is not served here; use {self.model_name!r} (see GET /v1/models)", "model"
            )

    @staticmethod
    def _check_unsupported(body: Mapping) -> None:
        n = body.get("n")
        if n is not None and (not _is_int(n) or n != 1):
            raise InvalidRequest(f"n must be 1 (one choice per request), got {n!r}", "n")
        for name, neutral in _UNSUPPORTED.items():
            if name in body and body[name] not in neutral:
                raise InvalidRequest(f"{name} is not supported by this server; remove it from the request", name)

    def _messages(self, messages: object) -> tuple[list[dict], int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty list of {role, content} objects", "messages")
        out, images = [], 0
        for i, message in enumerate(messages):
            parsed, count = self._message(i, message)
            out.append(parsed)
            images += count
        if images > self.max_images:
            raise InvalidRequest(
                f"the prompt has {images} images; at most {self.max_images} are allowed per prompt", "messages"
            )
        return out, images

    def _message(self, i: int, message: object) -> tuple[dict, int]:
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"{where} must be an object with role and content", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", "messages")
        content = message.get("content")
        if isinstance(content, str):
            return {"role": role, "content": content}, 0
        if not isinstance(content, list) or not content:
            raise InvalidRequest(f"{where}.content must be a string or a non-empty list of parts", "messages")
        parts = [self._part(f"{where}.content[{j}]", part) for j, part in enumerate(content)]
        return {"role": role, "content": parts}, sum(p["type"] == "image_url" for p in parts)

    def _part(self, where: str, part: object) -> dict:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}.text must be a string", "messages")
            return {"type": "text", "text": part["text"]}
        if kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, Mapping) else url
            return {"type": "image_url", "image_url": {"url": self._image_source(where, url)}}
        raise InvalidRequest(f"{where}: unsupported content part type {kind!r}; use 'text' or 'image_url'", "messages")

    def _image_source(self, where: str, url: object) -> str | bytes:
        if isinstance(url, bytes):
            return url
        if not isinstance(url, str) or not url:
            raise InvalidRequest(f"{where}.image_url.url must be a data:image/...;base64 URL", "messages")
        scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
        if scheme == "data":
            return url
        if scheme in ("http", "https"):
            if not self.allow_http_images:
                raise InvalidRequest(
                    f"{where}: remote image URLs (http/https) are disabled on this server; send the image as a "
                    "data:image/...;base64 URL (or start the proxy with --allow-http-image-urls)",
                    "messages",
                )
            return url
        if scheme in ("", "file") or len(scheme) == 1:  # a path, file://, or a Windows drive letter
            raise InvalidRequest(
                f"{where}: local file paths are not accepted; send the image as a data:image/...;base64 URL",
                "messages",
            )
        raise InvalidRequest(f"{where}: unsupported image URL scheme {scheme!r}; use a data: URL", "messages")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bool(body: Mapping, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {value!r}", name)
    return value


def _number(body: Mapping, name: str, default: float, low: float, high: float, shown: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be a number in {shown}, got {value!r}", name)
    return float(value)


def _top_p(body: Mapping, default: float) -> float:
    value = body.get("top_p")
    if value is None:
        return default
    if not _is_number(value) or not 0.0 < value <= 1.0:
        raise InvalidRequest(f"top_p must be a number in (0, 1], got {value!r}", "top_p")
    return float(value)


def _top_k(body: Mapping, default: int) -> int:
    value = body.get("top_k")
    if value is None:
        return default
    if not _is_int(value) or value < -1:
        raise InvalidRequest(f"top_k must be an integer >= 1, or 0 / -1 to disable it; got {value!r}", "top_k")
    return max(value, 0)


def _max_tokens(body: Mapping) -> int | None:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise InvalidRequest(f"{name} must be an integer >= 1, got {value!r}", name)
    return value


def _seed(body: Mapping) -> int | None:
    value = body.get("seed")
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value < _U64:
        raise InvalidRequest(f"seed must be an integer in [0, 2**64), got {value!r}", "seed")
    return value


def _stop(body: Mapping) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("stop must be a non-empty string or a list of non-empty strings", "stop")
    return tuple(dict.fromkeys(stops))


def _stop_token_ids(body: Mapping) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(t) and 0 <= t < 2**32 for t in value):
        raise InvalidRequest("stop_token_ids must be a list of token ids (integers >= 0)", "stop_token_ids")
    return tuple(value)


def _include_usage(body: Mapping, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, Mapping):
        raise InvalidRequest('stream_options must be an object such as {"include_usage": true}', "stream_options")
    return _bool(options, "include_usage", False)


# ----------------------------------------------------------------- responses


def usage(out: Output) -> dict:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
    }


def completion(request_id: str, model: str, text: str, last: Output) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": last.finish_reason,
            }
        ],
        "usage": usage(last),
    }


def chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(request_id: str, model: str, last: Output) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(last),
    }


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def models_list(model: str, max_model_len: int) -> dict:
    entry = {"id": model, "object": "model", "created": 0, "owned_by": "epd", "max_model_len": max_model_len}
    return {"object": "list", "data": [entry]}
