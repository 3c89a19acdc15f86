"""The proxy without model processes.

Part 1: pure pieces (request parsing, config, detokenizer, stop strings, replica picking,
DNS, the image fetcher).
Part 2: `python -m services.proxy` as a subprocess whose pool addresses are unreachable:
every bad input gets its 400 before any RPC, and valid requests fail fast with 503.
The proxy in front of real pools, and their failures, is in tests/test_proxy_failures.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from services.cluster import free_port
from services.proxy.config import ConfigError, PoolSource, parse_config, parse_size
from services.proxy.detokenizer import IncrementalDetokenizer
from services.proxy.errors import InvalidRequest, StageError
from services.proxy.openai_format import RequestParser
from services.proxy.replicas import ReplicaSet
from services.proxy.request import SamplingDefaults
from services.proxy.stop_strings import StopMatcher
from services.rpc import epd_pb2, epd_pb2_grpc
from tests.chat import image_part, user
from tests.conftest import make_image, png_bytes

MODEL = "tiny-qwen2_5_vl"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_checkpoint))


# =================================================================== part 1: pure pieces


def parser(**kw) -> RequestParser:
    return RequestParser(MODEL, kw.pop("max_images", 2), kw.pop("allow_http", False), SamplingDefaults(), **kw)


def test_parse_openai_request_fields():
    req = parser().parse(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, image_part(b"x")]},
            ],
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": -1,
            "seed": 3,
            "stop": "END",
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "n": 1,
        }
    )
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed) == (7, 0.0, 0.5, 0, 3)
    assert req.stop == ("END",) and req.stream and req.include_usage and req.ignore_eos
    assert req.num_images == 1 and req.messages[0] == {"role": "system", "content": "be brief"}
    defaults = parser().parse({"model": MODEL, "messages": user("hi"), "max_tokens": 4, "stop": ["a", "b", "a"]})
    assert (defaults.max_tokens, defaults.temperature, defaults.top_p, defaults.stream) == (4, 1.0, 1.0, False)
    assert defaults.stop == ("a", "b")
    assert parser().parse({"model": MODEL, "messages": user("hi")}).max_tokens is None


@pytest.mark.parametrize(
    "change, param, message",
    [
        ({"model": "gpt-4"}, "model", "model 'gpt-4' is not served here; use 'tiny-qwen2_5_vl'"),
        ({"messages": []}, "messages", "messages must be a non-empty list"),
        ({"temperature": 2.5}, "temperature", "temperature must be a number in [0, 2]"),
        ({"temperature": "hot"}, "temperature", "temperature must be a number in [0, 2]"),
        ({"top_p": 0}, "top_p", "top_p must be a number in (0, 1]"),
        ({"top_p": 1.01}, "top_p", "top_p must be a number in (0, 1]"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1"),
        ({"max_completion_tokens": -3}, "max_completion_tokens", "max_completion_tokens must be an integer >= 1"),
        ({"n": 2}, "n", "n must be 1"),
        ({"top_k": -5}, "top_k", "top_k must be an integer >= 1"),
        ({"seed": -1}, "seed", "seed must be an integer in [0, 2**64)"),
        ({"stop": [""]}, "stop", "stop must be a non-empty string or a list of non-empty strings"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
        ({"logprobs": True}, "logprobs", "logprobs is not supported"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "role must be one of system, user"),
    ],
)
def test_parse_rejects_with_a_message_that_says_what_to_fix(change, param, message):
    with pytest.raises(InvalidRequest) as info:
        parser().parse({"model": MODEL, "messages": user("hi"), **change})
    assert message in info.value.message
    assert info.value.param == param


def test_parse_image_sources():
    p = parser(allow_http=False)
    for url, message in [
        ("http://example.com/cat.png", "--allow-http-image-urls"),
        ("/etc/passwd", "local file paths are not accepted"),
        ("file:///etc/passwd", "local file paths are not accepted"),
        ("C:\\cat.png", "local file paths are not accepted"),
        ("ftp://host/cat.png", "unsupported image URL scheme 'ftp'"),
    ]:
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            p.parse({"model": MODEL, "messages": user({"type": "image_url", "image_url": {"url": url}})})
    allowed = parser(allow_http=True).parse(
        {"model": MODEL, "messages": user({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})}
    )
    assert allowed.messages[0]["content"][0]["image_url"]["url"] == "https://example.com/a.png"
    with pytest.raises(InvalidRequest, match="at most 2 are allowed per prompt"):
        p.parse({"model": MODEL, "messages": user(*[image_part(b"x")] * 3)})
    with pytest.raises(InvalidRequest, match="unsupported content part type 'input_audio'"):
        p.parse({"model": MODEL, "messages": user({"type": "input_audio", "input_audio": {}})})


def test_config_flags_env_and_errors(tiny_checkpoint):
    pools = ["--encoders", "10.0.0.1:5000,10.0.0.2:5000", "--prefills", "dns:///prefill.svc:6000"]
    config = parse_config(
        ["--checkpoint", str(tiny_checkpoint), *pools, "--max-image-bytes", "1MiB"],
        env={"EPD_DECODES": "d:7000", "EPD_HTTP_PORT": "9000", "EPD_ALLOW_HTTP_IMAGE_URLS": "true"},
    )
    assert config.model_name == MODEL and config.http_port == 9000 and config.allow_http_image_urls
    assert config.encoders.addresses == ("10.0.0.1:5000", "10.0.0.2:5000")
    assert (config.prefills.dns_name, config.prefills.dns_port) == ("prefill.svc", 6000)
    assert config.image_limits.max_bytes == 1 << 20 and config.image_limits.max_pixels == 50_000_000
    assert config.max_model_len == 4096
    assert parse_size("20MiB") == 20 * 1024 * 1024 and parse_size("50_000") == 50_000
    base = ["--checkpoint", str(tiny_checkpoint), *pools, "--decodes", "d:1"]
    for extra, message in [
        (["--decodes", "nohost"], "--decodes: 'nohost' is not host:port"),
        (["--max-model-len", "99999"], "over the model's max_position_embeddings"),
        (["--http-port", "70000"], "--http-port must be in 0..65535"),
        (["--max-image-bytes", "lots"], "is not a size"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config(base + extra, env={})
    with pytest.raises(ConfigError, match="--checkpoint is required"):
        parse_config(pools, env={})


def _stream_text(tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids]
    return pieces + [detok.flush()]


def test_detokenizer_incremental_equals_full_decode(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    texts = ["héllo 世界 🙂 naïve — ok", "日本語のテキスト🎉🎉", "a\u00a0b\u200bc 👩‍👩‍👧"]
    streams = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    streams += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(300)]
    for ids in streams:
        pieces = _stream_text(tokenizer, ids)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in p[-1:] for p in pieces[:-1]), "a piece ended in an incomplete character"


def test_detokenizer_holds_back_incomplete_characters(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # byte-level pieces of one character
    pieces = _stream_text(tokenizer, ids + tokenizer.convert_tokens_to_ids(["<|im_end|>"]))
    assert pieces[: len(ids) - 1] == [""] * (len(ids) - 1)
    assert pieces[len(ids) - 1] == "🙂" and "".join(pieces) == "🙂"


def _run_stops(stops, pieces):
    matcher = StopMatcher(stops)
    out = [matcher.feed(p) for p in pieces]
    if not matcher.stopped:
        out.append(matcher.flush())
    return "".join(out), matcher.stopped, out


def test_stop_strings_across_token_boundaries():
    text, stopped, out = _run_stops(["STOP"], ["Hello S", "T", "O", "P and more"])
    assert (text, stopped) == ("Hello ", True)
    assert "S" not in "".join(out[:3])  # a possible stop prefix is never released early
    assert _run_stops(["STOP"], ["Hello ST", "ART"]) == ("Hello START", False, ["Hello", " ST", "ART"])
    assert _run_stops(["xyz", "b"], ["axy", "zb"])[:2] == ("a", True)  # earliest match wins
    assert _run_stops([], ["a", "b"])[:2] == ("ab", False)
    assert _run_stops(["\n\n"], ["line\n", "\nnext"])[:2] == ("line", True)


def _replica_set(addresses, **kw) -> ReplicaSet:
    return ReplicaSet(PoolSource("decode", addresses=tuple(addresses)), epd_pb2_grpc.DecodeStub, **kw)


def test_least_outstanding_picking():
    async def scenario():
        pool = _replica_set(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], down_s=60)
        await pool.refresh_addresses()
        leases = []
        for _ in range(3):
            replica = pool.pick()
            leases.append(pool.lease(replica))
            await leases[-1].__aenter__()
        assert sorted(r.outstanding for r in pool.replicas.values()) == [1, 1, 1]
        await leases[0].__aexit__(None, None, None)
        assert pool.pick().address == "127.0.0.1:1"  # the only one with 0 outstanding
        assert pool.pick(prefer="127.0.0.1:3").address == "127.0.0.1:3"
        pool.mark_failed(pool.replicas["127.0.0.1:1"])
        assert {pool.pick().address for _ in range(4)} == {"127.0.0.1:2", "127.0.0.1:3"}
        with pytest.raises(StageError, match="no healthy decode replica") as info:
            pool.pick(exclude=["127.0.0.1:2", "127.0.0.1:3"])
        assert info.value.http_status == 503
        await pool.probe_all()  # nothing listens there: probes fail, no replica is usable
        assert pool.serving_count() == 0
        with pytest.raises(StageError):
            pool.pick()
        await pool.close()

    asyncio.run(scenario())


def test_dns_replica_set_resolves_and_re_resolves():
    async def scenario():
        source = PoolSource("prefill", dns_name="localhost", dns_port=6123)
        pool = ReplicaSet(source, epd_pb2_grpc.PrefillStub, health_interval_s=60, dns_refresh_s=0.05)
        await pool.start()
        assert list(pool.replicas) == ["127.0.0.1:6123"]
        old = pool.replicas.pop("127.0.0.1:6123")  # as if the record had gone; the next refresh brings it back
        await asyncio.sleep(0.3)
        assert list(pool.replicas) == ["127.0.0.1:6123"] and pool.replicas["127.0.0.1:6123"] is not old
        await old.channel.close()
        await pool.close()

    asyncio.run(scenario())


def test_image_fetcher_limits(tmp_path):
    from aiohttp import web

    from services.proxy.image_fetch import ImageFetcher

    picture = png_bytes(make_image(30, 30, 71))

    async def scenario():
        async def small(request):
            return web.Response(body=picture)

        async def big(request):
            return web.Response(body=b"x" * 5000)

        async def slow(request):
            await asyncio.sleep(2)
            return web.Response(body=picture)

        app = web.Application()
        for path, handler in (("/small.png", small), ("/big.png", big), ("/slow.png", slow)):
            app.router.add_get(path, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        fetcher = ImageFetcher(max_bytes=4000, timeout_s=0.5)
        try:
            assert await fetcher.fetch(base + "/small.png") == picture
            for path, message in [
                ("/big.png", "over the limit of 4000 bytes"),
                ("/missing.png", "returned HTTP 404"),
                ("/slow.png", "could not fetch image"),
            ]:
                with pytest.raises(InvalidRequest, match=message):
                    await fetcher.fetch(base + path)
        finally:
            await fetcher.close()
            await runner.cleanup()

    asyncio.run(scenario())


# =================================================================== part 2: subprocess, unreachable pools


class ProxyProcess:
    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.proxy", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(60):
            self.proc.kill()
            raise RuntimeError("proxy did not print its ready line:\n" + "".join(self.lines))
        match = re.search(r"epd-proxy listening on http://([\d.]+):(\d+)(?: grpc://[\d.]+:(\d+))?", self.lines[-1])
        self.url = f"http://{match.group(1)}:{match.group(2)}"
        self.grpc_port = int(match.group(3) or 0)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("epd-proxy listening on"):
                self.ready.set()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


def http(url: str, body: bytes | dict | None = None, method: str | None = None) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, raw = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


@pytest.fixture(scope="module")
def offline_proxy(tiny_checkpoint):
    dead = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    proxy = ProxyProcess(
        [
            "--checkpoint", str(tiny_checkpoint),
            "--http-port", "0",
            "--grpc-port", str(free_port()),
            "--encoders", dead[0], "--prefills", dead[1], "--decodes", dead[2],
            "--max-images-per-prompt", "2",
            "--max-image-bytes", "100KiB",
            "--max-image-pixels", "250000",
            "--max-model-len", "200",
            "--request-timeout-s", "10",
        ]
    )  # fmt: skip
    yield proxy
    assert proxy.stop() == 0, "".join(proxy.lines)


def _chat(**over) -> dict:
    return {"model": MODEL, "messages": user("Say hi."), "max_tokens": 8, **over}


def _noise_png(width: int, height: int) -> bytes:
    return png_bytes(make_image(width, height, seed=width))


BAD_INPUTS = {
    "invalid JSON": (b'{"model": ', "not valid JSON"),
    "not an object": (b"[1, 2]", "must be a JSON object"),
    "missing messages": ({"model": MODEL}, "messages must be a non-empty list"),
    "empty messages": (_chat(messages=[]), "messages must be a non-empty list"),
    "unknown model": (_chat(model="llama"), "model 'llama' is not served here"),
    "unsupported part": (_chat(messages=user({"type": "video_url", "video_url": {}})), "unsupported content part"),
    "undecodable image": (_chat(messages=user(image_part(b"not an image at all"))), "could not decode image"),
    "bad base64": (
        _chat(messages=user({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}})),
        "not valid base64",
    ),
    "image over bytes": (_chat(messages=user(image_part(_noise_png(400, 400)))), "over the limit of 102400 bytes"),
    "image over pixels": (
        _chat(messages=user(image_part(png_bytes(make_image(600, 600, 1).convert("L").point(lambda v: 0))))),
        "over the pixel limit of 250000",
    ),
    "too many images": (_chat(messages=user(*[image_part(b"x")] * 3)), "at most 2 are allowed per prompt"),
    "over context": (_chat(max_tokens=190), "over this model's context length of 200 tokens"),
    "prompt alone over context": (_chat(messages=user("word " * 400), max_tokens=None), "leaves no room for output"),
    "temperature": (_chat(temperature=-0.1), "temperature must be a number in [0, 2]"),
    "top_p": (_chat(top_p=0.0), "top_p must be a number in (0, 1]"),
    "max_tokens": (_chat(max_tokens=0), "max_tokens must be an integer >= 1"),
    "n": (_chat(n=3), "n must be 1"),
    "http url disabled": (
        _chat(messages=user({"type": "image_url", "image_url": {"url": "https://example.com/x.png"}})),
        "remote image URLs (http/https) are disabled",
    ),
    "local path": (
        _chat(messages=user({"type": "image_url", "image_url": {"url": "/etc/hosts"}})),
        "local file paths are not accepted",
    ),
    "file url": (
        _chat(messages=user({"type": "image_url", "image_url": {"url": "file:///etc/hosts"}})),
        "local file paths are not accepted",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_400_with_what_to_fix(offline_proxy, case):
    body, message = BAD_INPUTS[case]
    status, reply = http(offline_proxy.url + "/v1/chat/completions", body)
    assert status == 400, reply
    error = reply["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] is None and "param" in error


def test_valid_requests_fail_fast_when_pools_are_unreachable(offline_proxy):
    for body in (_chat(), _chat(stream=True), _chat(messages=user(image_part(_noise_png(64, 64)), "what?"))):
        began = time.monotonic()
        status, reply = http(offline_proxy.url + "/v1/chat/completions", body)
        assert time.monotonic() - began < 5
        assert status == 503, reply
        assert reply["error"]["type"] == "server_error" and "no healthy" in reply["error"]["message"]
    assert http(offline_proxy.url + "/v1/chat/completions", BAD_INPUTS["n"][0])[0] == 400  # still serving


def test_models_health_metrics_and_unknown_routes(offline_proxy):
    status, models = http(offline_proxy.url + "/v1/models")
    assert status == 200 and models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["object"] == "model"
    status, health = http(offline_proxy.url + "/health")
    assert status == 503 and health["missing"] == ["encoder", "prefill", "decode"]
    assert "encoder, prefill, decode" in health["message"]
    status, missing = http(offline_proxy.url + "/v2/nothing")
    assert status == 404 and "no route GET /v2/nothing" in missing["error"]["message"]
    assert http(offline_proxy.url + "/v1/chat/completions", method="GET")[0] == 405
    status, text = http(offline_proxy.url + "/metrics")
    assert status == 200
    for name in (
        "epd_proxy_requests_total",
        "epd_proxy_images_total",
        "epd_proxy_ttft_seconds_bucket",
        "epd_proxy_tpot_seconds_bucket",
        "epd_proxy_ec_hits_total",
        "epd_proxy_ec_misses_total",
    ):
        assert name in text
    for stage in ("tokenize", "encode", "prefill", "decode"):
        assert f'epd_proxy_stage_seconds_count{{stage="{stage}"}}' in text
    assert re.search(r'epd_proxy_requests_total\{status="invalid"\} [1-9]', text)


def test_grpc_front_door_rejects_with_the_http_message(offline_proxy):
    async def scenario():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{offline_proxy.grpc_port}") as channel:
            stub = epd_pb2_grpc.FrontendStub(channel)
            text = epd_pb2.ContentPart(text="hi")
            bad = epd_pb2.GenerateRequest(
                model=MODEL, messages=[epd_pb2.ChatMessage(role="user", content=[text])], temperature=3.0
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(bad, timeout=10):
                    pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            status, reply = http(offline_proxy.url + "/v1/chat/completions", _chat(temperature=3.0))
            assert info.value.details() == reply["error"]["message"]
            image = epd_pb2.ContentPart(image=epd_pb2.ImageInput(data=b"junk"))
            bad_image = epd_pb2.GenerateRequest(
                model=MODEL, messages=[epd_pb2.ChatMessage(role="user", content=[image])]
            )
            with pytest.raises(grpc.aio.AioRpcError, match="could not decode image"):
                async for _ in stub.Generate(bad_image, timeout=10):
                    pass
            good = epd_pb2.GenerateRequest(model=MODEL, messages=[epd_pb2.ChatMessage(role="user", content=[text])])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(good, timeout=10):
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_bad_flags_exit_2_with_a_message(tiny_checkpoint):
    result = subprocess.run(
        [sys.executable, "-m", "services.proxy", "--checkpoint", str(tiny_checkpoint), "--encoders", "x:1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--prefills is required" in result.stderr
