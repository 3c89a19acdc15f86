"""Gathers the items of concurrent Encode calls into vision-tower batches.

Invariants: a key is encoded at most once at a time (a later asker joins the
first one's future); a batch holds whole items within the patch budget, except
that an item over the budget on its own runs alone.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from PIL import Image

from services.encoder import metrics
from services.encoder.stage import EncoderStage, ItemMeta


@dataclass(frozen=True, eq=False)
class _Job:
    key: str
    image: Image.Image
    patches: int
    arrived: float  # event-loop time


class EncodeBatcher:
    def __init__(self, stage: EncoderStage, max_batch_patches: int, batch_wait_s: float) -> None:
        self._stage = stage
        self._max_patches = max_batch_patches
        self._wait_s = batch_wait_s
        self._pending: deque[_Job] = deque()
        self._inflight: dict[str, asyncio.Future[ItemMeta]] = {}
        self._wakeup = asyncio.Event()
        # One thread: the vision tower runs one batch at a time, off the event loop.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="vision-tower")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for future in self._inflight.values():
            if not future.done():
                future.set_exception(RuntimeError("the encoder is shutting down"))
        self._inflight.clear()
        self._worker.shutdown(wait=True)

    def in_flight(self, key: str) -> asyncio.Future[ItemMeta] | None:
        return self._inflight.get(key)

    def encode(self, key: str, image: Image.Image, patches: int) -> asyncio.Future[ItemMeta]:
        """The future meta of key, queueing it unless it is already being encoded."""
        future = self._inflight.get(key)
        if future is None:
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            future.add_done_callback(_consume_exception)
            self._inflight[key] = future
            self._pending.append(_Job(key, image, patches, loop.time()))
            self._wakeup.set()
        return future

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                delay = self._pending[0].arrived + self._wait_s - asyncio.get_running_loop().time()
                if delay > 0:
                    await asyncio.sleep(delay)  # let concurrent calls add their items
                await self._encode(self._take())

    def _take(self) -> list[_Job]:
        batch: list[_Job] = []
        used = 0
        while self._pending and (not batch or used + self._pending[0].patches <= self._max_patches):
            job = self._pending.popleft()
            batch.append(job)
            used += job.patches
        return batch

    async def _encode(self, batch: list[_Job]) -> None:
        started = time.perf_counter()
        try:
            results = await asyncio.get_running_loop().run_in_executor(self._worker, self._encode_sync, batch)
        except Exception as exc:
            results = [exc] * len(batch)
        metrics.BATCH_SECONDS.observe(time.perf_counter() - started)
        metrics.BATCH_ITEMS.observe(len(batch))
        for job, result in zip(batch, results):
            future = self._inflight.pop(job.key, None)
            if future is None or future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                metrics.ITEMS.labels(result="encoded").inc()
                future.set_result(result)

    def _encode_sync(self, batch: list[_Job]) -> list[ItemMeta | Exception]:
        encoded = self._stage.encode_keyed([job.key for job in batch], [job.image for job in batch])
        return [_try_publish(self._stage, item) for item in encoded]


def _try_publish(stage: EncoderStage, item) -> ItemMeta | Exception:
    try:
        return stage.publish(item)
    except Exception as exc:  # e.g. an entry over the store's size limit: fails only this item
        return exc


def _consume_exception(future: asyncio.Future) -> None:
    """Every asker may have gone away; don't log 'exception never retrieved' for that."""
    if not future.cancelled():
        future.exception()
