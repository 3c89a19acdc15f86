"""One chat request through the pools: prompt -> (encode || prefill) -> decode -> text.

Shared by the HTTP and gRPC front doors. `generate` raises InvalidRequest before it
yields anything (nothing has been sent to a pool then), and StageError at any point.
Every RPC gets the time left until the request's deadline. Once a prefill has handed
back a KV handle, any exit other than a finished decode stream releases that KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc

from services.multimodal.prompt import ChatPrompt
from services.proxy.config import ProxyConfig
from services.proxy.encode_client import EncodeClient
from services.proxy.errors import InvalidRequest, StageError
from services.proxy.image_fetch import ImageFetcher, fetch_remote_images
from services.proxy.metrics import ProxyMetrics
from services.proxy.output_text import OutputText
from services.proxy.pool_calls import PoolCalls, Prefilled
from services.proxy.prompts import PromptWorkers
from services.proxy.replicas import ReplicaSet
from services.proxy.request import ChatRequest, Output
from services.rpc import epd_pb2

log = logging.getLogger("epd.proxy")


@dataclass(frozen=True)
class Pools:
    encoders: ReplicaSet
    prefills: ReplicaSet
    decodes: ReplicaSet

    def __iter__(self) -> Iterator[ReplicaSet]:
        return iter((self.encoders, self.prefills, self.decodes))


class Pipeline:
    def __init__(
        self,
        config: ProxyConfig,
        prompts: PromptWorkers,
        pools: Pools,
        encoder: EncodeClient,
        metrics: ProxyMetrics,
        fetcher: ImageFetcher,
    ) -> None:
        self.config = config
        self.prompts = prompts
        self.encoder = encoder
        self.calls = PoolCalls(pools.prefills, pools.decodes)
        self.metrics = metrics
        self.fetcher = fetcher

    async def generate(self, request: ChatRequest, request_id: str) -> AsyncIterator[Output]:
        start = time.monotonic()
        deadline = start + self.config.request_timeout_s
        try:
            prompt, sampling = await self._prepare(request)
            prefilled = await self._encode_and_prefill(request_id, prompt, sampling, deadline)
            async for out in self._outputs(request, request_id, prompt, prefilled, start, deadline):
                yield out
        except InvalidRequest:
            self.metrics.requests.labels("invalid").inc()
            raise
        except StageError as exc:
            self.metrics.requests.labels("error").inc()
            log.warning("request %s: %s", request_id, exc.message)
            raise
        self.metrics.requests.labels("ok").inc()

    async def close(self) -> None:
        await self.calls.close()

    # ------------------------------------------------------------------ prompt

    async def _prepare(self, request: ChatRequest) -> tuple[ChatPrompt, epd_pb2.Sampling]:
        with self._timed("tokenize"):
            messages = await fetch_remote_images(request.messages, self.fetcher)
            prompt = await self.prompts.build(messages)
        sampling = epd_pb2.Sampling(
            max_tokens=self._max_tokens(request, len(prompt.token_ids)),
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
        )
        self.metrics.images.inc(len(prompt.features))
        return prompt, sampling

    def _max_tokens(self, request: ChatRequest, prompt_len: int) -> int:
        limit = self.config.max_model_len
        room = limit - prompt_len
        if request.max_tokens is None:
            if room < 1:
                raise InvalidRequest(
                    f"the prompt is {prompt_len} tokens, which leaves no room for output in this model's "
                    f"context length of {limit} tokens; shorten the messages",
                    "messages",
                )
            return min(self.config.default_max_tokens, room)
        if request.max_tokens > room:
            fix = f"lower max_tokens to at most {room}" if room >= 1 else "shorten the messages"
            raise InvalidRequest(
                f"the prompt is {prompt_len} tokens and max_tokens is {request.max_tokens}: "
                f"{prompt_len + request.max_tokens} is over this model's context length of {limit} tokens; {fix}",
                "max_tokens",
            )
        return request.max_tokens

    # ------------------------------------------------------------------ encode and prefill

    async def _encode_and_prefill(
        self, request_id: str, prompt: ChatPrompt, sampling: epd_pb2.Sampling, deadline: float
    ) -> Prefilled:
        """Text-only prompts never reach the encoder pool. With images, prefill is sent at
        once and waits on the prefill side for the embeddings the encode publishes."""
        if not prompt.features:
            return await self._prefill(request_id, prompt, sampling, deadline)
        encode = asyncio.create_task(self._encode(request_id, prompt, deadline))
        prefill = asyncio.create_task(self._prefill(request_id, prompt, sampling, deadline))
        try:
            await asyncio.wait({encode, prefill}, return_when=asyncio.FIRST_EXCEPTION)
            if encode.done() and encode.exception() is not None:
                raise encode.exception()
            return prefill.result()  # both succeeded, or the prefill's error
        finally:
            self._abandon(encode, prefill)

    def _abandon(self, encode: asyncio.Task, prefill: asyncio.Task) -> None:
        """Cancel what still runs (the shared encode itself goes on in EncodeClient); a prefill
        that succeeded although the encode failed gives its KV back."""
        encode.cancel()
        prefill.cancel()
        encode_failed = encode.done() and not encode.cancelled() and encode.exception() is not None
        prefill_ok = prefill.done() and not prefill.cancelled() and prefill.exception() is None
        if encode_failed and prefill_ok:
            self.calls.release_later(prefill.result())

    async def _encode(self, request_id: str, prompt: ChatPrompt, deadline: float) -> None:
        items = [(f.key, data) for f, data in zip(prompt.features, prompt.image_files)]
        with self._timed("encode"):
            metas = await self.encoder.ensure(request_id, items, deadline)
        for index, feature in enumerate(prompt.features):
            meta = metas.get(feature.key)
            if meta is not None and meta.rows != feature.length:
                raise StageError(
                    "encode",
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the encoder made {meta.rows} embedding rows for image {index + 1}, but the prompt has "
                    f"{feature.length} placeholders: the proxy and the encoders use different checkpoints",
                )

    async def _prefill(
        self, request_id: str, prompt: ChatPrompt, sampling: epd_pb2.Sampling, deadline: float
    ) -> Prefilled:
        features = [
            epd_pb2.FeatureSpec(key=f.key, offset=f.offset, length=f.length, grid_thw=list(f.grid_thw))
            for f in prompt.features
        ]
        request = epd_pb2.PrefillRequest(
            request_id=request_id, token_ids=prompt.token_ids, features=features, sampling=sampling
        )
        with self._timed("prefill"):
            return await self.calls.prefill(request, deadline)

    # ------------------------------------------------------------------ tokens -> text

    async def _outputs(
        self,
        request: ChatRequest,
        request_id: str,
        prompt: ChatPrompt,
        prefilled: Prefilled,
        start: float,
        deadline: float,
    ) -> AsyncIterator[Output]:
        text = OutputText(self.prompts.tokenizer, request.stop, len(prompt.token_ids))
        reply = prefilled.reply
        first = text.add([reply.first_token])
        first_at = time.monotonic()
        self.metrics.ttft.observe(first_at - start)
        if reply.finished and not text.stopped:
            first = _merge(first, text.finish(reply.finish_reason or "stop"))
        completed = reply.finished
        try:
            yield first
            if first.finish_reason is None:
                async for out in self._decode(request_id, text, prefilled, deadline):
                    completed = out.finish_reason is not None and not text.stopped
                    yield out
        finally:
            if not completed:
                self.calls.release_later(prefilled)
        if text.completion_tokens > 1:
            self.metrics.tpot.observe((time.monotonic() - first_at) / (text.completion_tokens - 1))

    async def _decode(
        self, request_id: str, text: OutputText, prefilled: Prefilled, deadline: float
    ) -> AsyncIterator[Output]:
        with self._timed("decode"):
            async with contextlib.aclosing(self.calls.decode(request_id, prefilled, deadline)) as chunks:
                async for chunk in chunks:
                    out = text.add(chunk.token_ids)
                    if not text.stopped and chunk.finished:
                        out = _merge(out, text.finish(chunk.finish_reason or "stop"))
                    yield out
                    if out.finish_reason is not None:
                        return  # closing `chunks` cancels a stream that a stop string ended

    @contextlib.contextmanager
    def _timed(self, stage: str) -> Iterator[None]:
        began = time.monotonic()
        yield
        self.metrics.stage.labels(stage).observe(time.monotonic() - began)


def _merge(a: Output, b: Output) -> Output:
    return Output(
        text=a.text + b.text,
        token_ids=a.token_ids + b.token_ids,
        finish_reason=b.finish_reason or a.finish_reason,
        prompt_tokens=a.prompt_tokens,
        completion_tokens=max(a.completion_tokens, b.completion_tokens),
    )
