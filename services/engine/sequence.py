"""A request as the language stages see it: token ids, feature specs, sampling, state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class RequestError(ValueError):
    """A request that cannot be served as given; the message says what to fix."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise RequestError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class FeatureSpec:
    """One multimodal item of a prompt: its embeddings are `length` rows stored under `key`
    and replace the placeholder tokens prompt[offset : offset + length]."""

    key: str
    offset: int
    length: int
    grid_thw: tuple[int, int, int]


class Status(enum.Enum):
    WAITING = "waiting"  # queued for prefill (possibly still waiting for embeddings)
    RUNNING = "running"  # in the decode batch
    AWAITING_HANDOFF = "awaiting_handoff"  # prefilled by a prefill-only engine; KV not yet taken
    FINISHED = "finished"


class ErrorKind(str, enum.Enum):
    INVALID = "invalid"  # the request cannot be served as given (e.g. embeddings don't fit the prompt)
    FEATURE_TIMEOUT = "feature_timeout"  # its embeddings did not reach the EC store in time


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ERROR = "error"
    ABORT = "abort"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    features: list[FeatureSpec] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    reserved_blocks: int = 0  # blocks promised at admission but not yet allocated
    mrope_delta: int = 0  # decode token i sits at position i + mrope_delta on every axis
    prompt_positions: torch.Tensor | None = None  # [3, prompt_len], set at admission
    feature_deadline: float = float("inf")  # monotonic time; waiting past it fails the request
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.sampling.max_tokens

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True)
class StepOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
