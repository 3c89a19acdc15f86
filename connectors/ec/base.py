"""Encoder-cache (EC) connector interface.

The encoder pool publishes per-image embeddings under a content hash; the
prefill pool reads them. Keys are content addresses: one key always names the
same bytes, so the first writer wins and later puts of that key are no-ops.
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

MAX_KEY_LEN = 200
_KEY_RE = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]*")

# wait() polling backoff: starts short so a just-published entry is seen fast.
_WAIT_FIRST_S = 0.001
_WAIT_MAX_S = 0.05


class ECError(Exception):
    """Base class for EC connector errors."""


class ECTimeoutError(ECError, TimeoutError):
    """An entry did not appear within the wait timeout."""


class ECCorruptEntryError(ECError):
    """Stored bytes are truncated or damaged; the bad entry has been removed."""


@dataclass(frozen=True, eq=False)  # tensors have no boolean ==; compare .tensor with torch.equal
class ECEntry:
    tensor: torch.Tensor  # [rows, width], on CPU
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def width(self) -> int:
        return int(self.tensor.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype


@dataclass(frozen=True)
class ECStats:
    bytes_used: int  # encoded bytes of all live entries
    entries: int


def validate_key(key: str) -> str:
    """Return key if it is a safe store key, else raise ValueError."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"EC key must be a non-empty str, got {key!r}")
    if len(key) > MAX_KEY_LEN:
        raise ValueError(f"EC key is {len(key)} chars, max is {MAX_KEY_LEN}: {key[:40]!r}...")
    if not _KEY_RE.fullmatch(key):
        raise ValueError(f"EC key {key!r} is invalid: use only [0-9A-Za-z_.-], starting with a letter or digit")
    return key


class ECProducer(ABC):
    @abstractmethod
    def put(self, key: str, tensor: torch.Tensor, meta: Mapping[str, str] | None = None) -> bool:
        """Store tensor under key. True if this call stored it, False if key already existed."""


class ECConsumer(ABC):
    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def get(self, key: str) -> ECEntry | None:
        """Entry for key, or None if missing.

        Raises ECCorruptEntryError (after removing the entry) if the stored bytes are bad.
        """

    def wait(self, key: str, timeout_s: float) -> ECEntry:
        """Poll get() with backoff until the entry appears; ECTimeoutError after timeout_s."""
        validate_key(key)
        deadline = time.monotonic() + timeout_s
        delay = _WAIT_FIRST_S
        while True:
            entry = self.get(key)
            if entry is not None:
                return entry
            left = deadline - time.monotonic()
            if left <= 0:
                raise ECTimeoutError(f"EC entry {key!r} not available after waiting {timeout_s:g}s")
            time.sleep(min(delay, left))
            delay = min(delay * 2, _WAIT_MAX_S)


class ECStore(ECProducer, ECConsumer):
    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove key; True if it existed."""

    @abstractmethod
    def stats(self) -> ECStats: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> ECStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
