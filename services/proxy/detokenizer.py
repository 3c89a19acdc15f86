"""Incremental detokenization whose pieces join to exactly the full decode.

Each step decodes a short window: the tokens since `prefix` and the tokens since
`prefix` up to `read`. The text they add beyond the window's old text is new, unless
it ends in U+FFFD (an incomplete UTF-8 character), which is held back until a later
token completes it. `prefix` only moves to a point where the decoded text ended on a
whole character, so windows start where the full decode has no pending bytes.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens before this are already turned into emitted text

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        return self._step(final=False)

    def flush(self) -> str:
        """The text held back at the end (an incomplete character decodes as U+FFFD)."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self.read == len(self.token_ids):
            return ""
        old = self._decode(self.token_ids[self.prefix : self.read])
        new = self._decode(self.token_ids[self.prefix :])
        if not final and (len(new) <= len(old) or new.endswith(REPLACEMENT)):
            return ""
        self.prefix, self.read = self.read, len(self.token_ids)
        return new[len(old) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special) if ids else ""
