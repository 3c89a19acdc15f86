"""Configuration of a language-model engine (prefill, decode, or both)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

# both: prefill then decode in place; prefill: hold KV for export after the first token;
# decode: take exported KV; pd: hold KV after prefill, then export it or resume decoding here.
Role = Literal["both", "prefill", "decode", "pd"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    role: Role = "both"
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192  # prompt tokens per prefill step
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    feature_timeout_s: float = 30.0  # how long a prompt may wait for its embeddings

    def __post_init__(self) -> None:
        if self.role not in ("both", "prefill", "decode", "pd"):
            raise ValueError(f"role must be 'both', 'prefill', 'decode' or 'pd', got {self.role!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
