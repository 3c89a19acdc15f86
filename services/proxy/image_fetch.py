"""http(s) image URLs -> image bytes, bounded in time and size (only with --allow-http-image-urls)."""

from __future__ import annotations

import asyncio

import aiohttp

from services.proxy.errors import InvalidRequest

_MAX_REDIRECTS = 3


class ImageFetcher:
    def __init__(self, max_bytes: int, timeout_s: float) -> None:
        self.max_bytes = max_bytes
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def fetch(self, url: str) -> bytes:
        try:
            async with self._client().get(url, max_redirects=_MAX_REDIRECTS) as response:
                if response.status != 200:
                    raise InvalidRequest(f"fetching image {url!r} returned HTTP {response.status}", "messages")
                return await self._read(url, response)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise InvalidRequest(f"could not fetch image {url!r}: {exc!r}", "messages") from None

    async def _read(self, url: str, response: aiohttp.ClientResponse) -> bytes:
        if response.content_length is not None and response.content_length > self.max_bytes:
            raise self._too_large(url, response.content_length)
        data = bytearray()
        async for block in response.content.iter_chunked(1 << 16):
            data += block
            if len(data) > self.max_bytes:
                raise self._too_large(url, len(data))
        return bytes(data)

    def _too_large(self, url: str, size: int) -> InvalidRequest:
        return InvalidRequest(
            f"image {url!r} is {size} bytes or more, over the limit of {self.max_bytes} bytes", "messages"
        )

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def fetch_remote_images(messages: list[dict], fetcher: ImageFetcher) -> list[dict]:
    """The messages with every http(s) image URL replaced by the fetched bytes."""
    urls = list(dict.fromkeys(_remote_urls(messages)))
    if not urls:
        return messages
    fetched = dict(zip(urls, await asyncio.gather(*(fetcher.fetch(url) for url in urls))))
    return [_with_images(m, fetched) for m in messages]


def _remote_urls(messages: list[dict]) -> list[str]:
    parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image_url"]
    urls = [p["image_url"]["url"] for p in parts]
    return [u for u in urls if isinstance(u, str) and u[:8].lower().startswith(("http://", "https://"))]


def _with_images(message: dict, fetched: dict[str, bytes]) -> dict:
    if not isinstance(message["content"], list):
        return message
    parts = [
        {"type": "image_url", "image_url": {"url": fetched[p["image_url"]["url"]]}}
        if p["type"] == "image_url" and p["image_url"]["url"] in fetched
        else p
        for p in message["content"]
    ]
    return {**message, "content": parts}
