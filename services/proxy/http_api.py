"""The OpenAI-compatible HTTP front door: a thin adapter over the pipeline."""

from __future__ import annotations

import contextlib
import json
import logging
import uuid

from aiohttp import web

from services.proxy import openai_format as fmt
from services.proxy.config import ProxyConfig
from services.proxy.errors import InvalidRequest, StageError
from services.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from services.proxy.openai_format import RequestParser
from services.proxy.pipeline import Pipeline, Pools
from services.proxy.request import ChatRequest, Output

log = logging.getLogger("epd.proxy")
ROUTES = "POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"


class HttpApi:
    def __init__(
        self, config: ProxyConfig, parser: RequestParser, pipeline: Pipeline, pools: Pools, metrics: ProxyMetrics
    ) -> None:
        self.config = config
        self.parser = parser
        self.pipeline = pipeline
        self.pools = pools
        self.metrics = metrics

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error(exc.status, self._http_message(request, exc), "invalid_request_error")
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return _error(500, "internal error in the proxy (see its log)", "server_error")

    def _http_message(self, request: web.Request, exc: web.HTTPException) -> str:
        if exc.status == 404:
            return f"no route {request.method} {request.path}; this server has {ROUTES}"
        if exc.status == 405:
            return f"{request.method} is not allowed on {request.path}; this server has {ROUTES}"
        if exc.status == 413:
            limit = self.config.max_body_bytes
            return f"the request body is over the limit of {limit} bytes; send fewer or smaller images"
        return exc.text or exc.reason

    # ------------------------------------------------------------------ routes

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(fmt.models_list(self.config.model_name, self.config.max_model_len))

    async def health(self, request: web.Request) -> web.Response:
        pools = {p.pool: {"healthy": p.serving_count(), "replicas": len(p.replicas)} for p in self.pools}
        missing = [name for name, counts in pools.items() if counts["healthy"] == 0]
        if not missing:
            return web.json_response({"status": "ok", "pools": pools})
        message = f"no healthy replica in pool(s): {', '.join(missing)}"
        return web.json_response(
            {"status": "unavailable", "message": message, "missing": missing, "pools": pools}, status=503
        )

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            chat = self.parser.parse(await _json_body(request))
        except InvalidRequest as exc:
            self.metrics.requests.labels("invalid").inc()
            return _invalid(exc)
        outputs = self.pipeline.generate(chat, request_id)
        async with contextlib.aclosing(outputs):
            try:
                first = await anext(outputs)
            except InvalidRequest as exc:
                return _invalid(exc)
            except StageError as exc:
                return _stage_error(exc)
            if chat.stream:
                return await self._stream(request, request_id, chat, first, outputs)
            return await self._complete(request_id, first, outputs)

    # ------------------------------------------------------------------ responses

    async def _complete(self, request_id: str, first: Output, outputs) -> web.Response:
        text, last = [first.text], first
        try:
            async for out in outputs:
                text.append(out.text)
                last = out
        except StageError as exc:
            return _stage_error(exc)
        return web.json_response(fmt.completion(request_id, self.config.model_name, "".join(text), last))

    async def _stream(self, request: web.Request, request_id: str, chat: ChatRequest, first: Output, outputs):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        model = self.config.model_name
        send = _SseWriter(response)
        try:
            await send(fmt.chunk(request_id, model, {"role": "assistant", "content": ""}))
            last = await self._send_output(send, request_id, first)
            async for out in outputs:
                last = await self._send_output(send, request_id, out)
            if chat.include_usage:
                await send(fmt.usage_chunk(request_id, model, last))
        except StageError as exc:
            await send(fmt.error_body(exc.message, "server_error", None, exc.error_code))
        except ConnectionError:  # the client went away: closing `outputs` cancels the decode
            return response
        await send.done()
        return response

    async def _send_output(self, send: _SseWriter, request_id: str, out: Output) -> Output:
        model = self.config.model_name
        if out.finish_reason is not None:
            delta = {"content": out.text} if out.text else {}
            await send(fmt.chunk(request_id, model, delta, out.finish_reason))
        elif out.text:
            await send(fmt.chunk(request_id, model, {"content": out.text}))
        return out


class _SseWriter:
    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    async def __call__(self, payload: dict) -> None:
        await self.response.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")

    async def done(self) -> None:
        with contextlib.suppress(ConnectionError):
            await self.response.write(b"data: [DONE]\n\n")
            await self.response.write_eof()


async def _json_body(request: web.Request) -> object:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}", None) from None


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> web.Response:
    return web.json_response(fmt.error_body(message, kind, param, code), status=status)


def _invalid(exc: InvalidRequest) -> web.Response:
    return _error(400, exc.message, "invalid_request_error", exc.param)


def _stage_error(exc: StageError) -> web.Response:
    kind = "invalid_request_error" if exc.http_status == 400 else "server_error"
    return _error(exc.http_status, exc.message, kind, None, exc.error_code)
