"""The two ways a request fails: the client sent something unusable, or a pool stage failed."""

from __future__ import annotations

import grpc


class InvalidRequest(ValueError):
    """Bad client input (HTTP 400, gRPC INVALID_ARGUMENT); the message says what to fix."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class StageError(RuntimeError):
    """A pool stage (encode, prefill, decode) could not serve the request."""

    def __init__(self, stage: str, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(f"{stage} failed: {detail}")
        self.stage = stage
        self.code = code
        self.detail = detail
        self.message = f"{stage} failed: {detail}"

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS.get(self.code, 502)

    @property
    def error_code(self) -> str:
        return self.code.name.lower()


_HTTP_STATUS = {
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.CANCELLED: 499,
}


def stage_error(stage: str, error: grpc.aio.AioRpcError, address: str) -> StageError:
    return StageError(stage, error.code(), f"{error.code().name} from {address}: {error.details() or 'no details'}")
