"""Our exceptions and the gRPC status each one ends an RPC with, decided here only.

Servicers raise; `StatusInterceptor` turns the exception into a status whose
details are the exception's message. Anything unexpected is INTERNAL (and logged).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import grpc

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error that carries its own status code."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class FeatureTimeoutError(ServiceError):
    """A prompt's embeddings did not reach the EC store in time."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class HandoffNotFoundError(ServiceError):
    """No held KV under this handoff id (never existed, released, or reaped)."""

    code = grpc.StatusCode.NOT_FOUND


class KVPullError(ServiceError):
    """The KV could not be pulled from the prefill side."""

    code = grpc.StatusCode.UNAVAILABLE


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, ServiceError):
        return exc.code
    if isinstance(exc, ValueError):  # RequestError, ImageInputError, KVHandoffError
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("internal error", exc_info=exc)
    await context.abort(code, str(exc) or type(exc).__name__)


class StatusInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_guard_unary(handler.unary_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_guard_stream(handler.unary_stream))
        return handler


def _guard_unary(behavior: Callable) -> Callable:
    async def guarded(request, context):
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    return guarded


def _guard_stream(behavior: Callable) -> Callable:
    if not inspect.isasyncgenfunction(behavior):  # writes with context.write (health Watch)
        return _guard_unary(behavior)

    async def guarded(request, context):
        try:
            async for item in behavior(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    return guarded
