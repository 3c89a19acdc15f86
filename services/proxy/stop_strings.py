"""Stop strings matched on the detokenized text, across token boundaries.

The last (longest stop - 1) characters are held back: they could be the start of a
stop string that the next token completes, and a matched stop string is never shown.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""  # text not yet released
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to release; sets `stopped` when a stop string appears (nothing after it is released)."""
        if self.stopped:
            return ""
        buffer = self.pending + text
        cut = self._first_stop(buffer)
        if cut is not None:
            self.stopped, self.pending = True, ""
            return buffer[:cut]
        keep = min(self.hold, len(buffer))
        self.pending = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None
