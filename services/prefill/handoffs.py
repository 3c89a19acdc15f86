"""Handoff ids of prefilled requests whose KV is held in the engine until released.

A handoff not released within the hold timeout is freed by its timer, so a
decoder that died mid-transfer cannot pin KV blocks forever. Lives on the
event loop (no locks); the engine is reached only through the EngineLoop.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

from services.common.engine_loop import EngineLoop
from services.common.errors import HandoffNotFoundError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Held:
    request_id: str
    timer: asyncio.TimerHandle


class HeldHandoffs:
    def __init__(self, engine: EngineLoop, hold_timeout_s: float) -> None:
        self._engine = engine
        self._timeout_s = hold_timeout_s
        self._held: dict[str, _Held] = {}

    def hold(self, request_id: str) -> str:
        """A new handoff id for a request the engine now holds; starts its release timer."""
        handoff_id = uuid.uuid4().hex
        timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expire, handoff_id)
        self._held[handoff_id] = _Held(request_id, timer)
        return handoff_id

    def holds(self, handoff_id: str) -> bool:
        return handoff_id in self._held

    def request_of(self, handoff_id: str) -> str:
        held = self._held.get(handoff_id)
        if held is None:
            raise self._not_found(handoff_id)
        return held.request_id

    def take(self, handoff_id: str) -> str:
        """Forget the handoff (its KV is released or resumed by the caller); returns the request id."""
        held = self._held.pop(handoff_id, None)
        if held is None:
            raise self._not_found(handoff_id)
        held.timer.cancel()
        return held.request_id

    def release_all(self) -> None:
        for handoff_id in list(self._held):
            self._expire(handoff_id)

    def _expire(self, handoff_id: str) -> None:
        held = self._held.pop(handoff_id, None)
        if held is None:
            return
        held.timer.cancel()
        log.warning("handoff %s was not released within %g s: freeing its KV", handoff_id, self._timeout_s)
        self._engine.post(lambda engine: engine.release_handoff(held.request_id))

    def _not_found(self, handoff_id: str) -> HandoffNotFoundError:
        return HandoffNotFoundError(
            f"KV handoff {handoff_id!r} is not held here: it was released already, or it was not released "
            f"within --kv-hold-timeout-s ({self._timeout_s:g} s) and its KV was freed"
        )
