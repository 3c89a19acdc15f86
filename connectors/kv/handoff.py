"""KV handoff: a prefilled sequence's state and K/V, in a transport-neutral form.

K/V travel token-major ([layers, 2, tokens, kv_heads, head_dim]) rather than as
blocks, so sender and receiver may use different block sizes and block ids.
Wire form: magic, 4-byte little-endian header length, JSON header, raw K/V bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass

import torch

MAGIC = b"EPDKV1\n"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVHandoffError(ValueError):
    """A handoff that cannot be imported; the message says why."""


@dataclass(frozen=True)
class HandoffState:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    sampling: dict  # SamplingParams fields
    mrope_delta: int
    num_cached: int  # tokens whose K/V are in `kv`
    model: str  # fingerprint of the language model that produced the K/V


@dataclass(frozen=True)
class KVHandoff:
    state: HandoffState
    kv: torch.Tensor  # [layers, 2, num_cached, kv_heads, head_dim], on CPU

    def to_bytes(self) -> bytes:
        kv = self.kv.contiguous()
        return _prefix(self.state, list(kv.shape), kv.dtype) + kv.view(torch.uint8).numpy().tobytes()

    @staticmethod
    def wire_size(state: HandoffState, shape: list[int], dtype: torch.dtype) -> int:
        """len(to_bytes()) of a handoff with this state and K/V shape, without building it."""
        return len(_prefix(state, shape, dtype)) + dtype.itemsize * _numel(shape)

    @staticmethod
    def from_bytes(buf: bytes) -> "KVHandoff":
        if not buf.startswith(MAGIC):
            raise KVHandoffError("not a KV handoff (bad magic)")
        (n,) = struct.unpack_from("<I", buf, len(MAGIC))
        start = len(MAGIC) + 4
        header = json.loads(buf[start : start + n])
        dtype = _DTYPES.get(header["dtype"])
        if dtype is None:
            raise KVHandoffError(f"unsupported K/V dtype {header['dtype']!r}")
        payload = memoryview(buf)[start + n :]
        shape = header["shape"]
        expected = dtype.itemsize * _numel(shape)
        if len(payload) != expected:
            raise KVHandoffError(f"K/V payload is {len(payload)} bytes, header says {expected}")
        kv = torch.frombuffer(bytearray(payload), dtype=dtype).view(shape)
        return KVHandoff(HandoffState(**header["state"]), kv)


def _prefix(state: HandoffState, shape: list[int], dtype: torch.dtype) -> bytes:
    header = {"state": asdict(state), "shape": shape, "dtype": str(dtype).removeprefix("torch.")}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(raw)) + raw


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
