"""The gRPC front door (Frontend.Generate): a thin adapter over the same pipeline and the same
request validation as the HTTP API, so both give the same messages and outputs."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import grpc

from services.proxy.errors import InvalidRequest, StageError
from services.proxy.metrics import ProxyMetrics
from services.proxy.openai_format import RequestParser
from services.proxy.pipeline import Pipeline
from services.proxy.request import Output
from services.rpc import epd_pb2, epd_pb2_grpc

_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "top_k")


class Frontend(epd_pb2_grpc.FrontendServicer):
    def __init__(self, parser: RequestParser, pipeline: Pipeline, metrics: ProxyMetrics) -> None:
        self.parser = parser
        self.pipeline = pipeline
        self.metrics = metrics

    async def Generate(
        self, request: epd_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[epd_pb2.GenerateResponse]:
        try:
            chat = self.parser.parse(openai_body(request))
        except InvalidRequest as exc:
            self.metrics.requests.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        outputs = self.pipeline.generate(chat, f"gen-{uuid.uuid4().hex}")
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    yield response_of(out)
            except InvalidRequest as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
            except StageError as exc:
                await context.abort(exc.code, exc.message)


def openai_body(request: epd_pb2.GenerateRequest) -> dict:
    """The request as the JSON body of POST /v1/chat/completions with stream=true."""
    body: dict = {
        "model": request.model,
        "messages": [{"role": m.role, "content": [_part(p) for p in m.content]} for m in request.messages],
        "stream": True,
    }
    for name in _OPTIONAL_FIELDS:
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.ignore_eos:
        body["ignore_eos"] = True
    return body


def _part(part: epd_pb2.ContentPart) -> dict:
    kind = part.WhichOneof("part")
    if kind == "text":
        return {"type": "text", "text": part.text}
    if kind == "image":
        source = part.image.WhichOneof("source")
        url = part.image.data if source == "data" else part.image.url if source == "url" else None
        return {"type": "image_url", "image_url": {"url": url}}
    return {"type": None}


def response_of(out: Output) -> epd_pb2.GenerateResponse:
    response = epd_pb2.GenerateResponse(text=out.text, token_ids=out.token_ids)
    if out.finish_reason is not None:
        response.finished = True
        response.finish_reason = out.finish_reason
        response.usage.CopyFrom(epd_pb2.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens))
    return response
