"""The proxy in front of REAL pools, and what it does when they fail.

One LocalCluster (two encoders, prefill, decode and its proxy, filesystem EC store), a
third encoder whose processor config differs (other content keys), and three more proxy
processes over the same pools with their own flags. Failures are real: SIGKILL, SIGSTOP /
SIGCONT, deadlines, clients that go away. What happened inside the pools is read from
their Prometheus /metrics endpoints.

Order matters at the end of the module: the tests that kill the encoders and the one that
stops a proxy come last. A proxy sends its first Encode to the first encoder it lists
(least-outstanding picking, ties in list order), so each test that needs a particular
replica to be tried first is the first to send images through its proxy.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.cluster import ClusterConfig, LocalCluster, Service, free_port
from services.rpc import epd_pb2, epd_pb2_grpc
from tests.chat import image_part, user
from tests.conftest import make_image, png_bytes
from tests.pool_procs import REPO_ROOT, ServiceProcess, clean_env, spawn, wait_serving

MODEL = "tiny-qwen2_5_vl"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
LONG = 3000  # max_tokens that take the CPU decode many seconds (about 200 tokens/s)
RETRY_TIMEOUT_S = 4.0  # the `retry` proxy's --request-timeout-s


# ------------------------------------------------------------------ helpers


def picture(seed: int, width: int = 64, height: int = 48) -> bytes:
    """A PNG no other test uses: its content key is new to the EC store."""
    return png_bytes(make_image(width, height, seed))


def sample(metrics_text: str, name: str, **labels: str) -> float:
    want = tuple(sorted(labels.items()))
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == name and tuple(sorted(s.labels.items())) == want:
                return s.value
    return 0.0


def wait_until(condition: Callable[[], bool], timeout_s: float, message: str, interval_s: float = 0.05) -> float:
    """Polls until condition() holds; returns the seconds it took."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"{message} within {timeout_s:g} s")
        time.sleep(interval_s)
    return time.monotonic() - began


@dataclass
class ProxyProc(Service):
    """A `python -m services.proxy` process: serves HTTP (and /metrics) on `port`, gRPC on `grpc_port`."""

    grpc_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, timeout: float = 60) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def chat(self, messages, **kw):
        return self.client().chat.completions.create(model=MODEL, messages=messages, **kw)

    def stream(self, messages, **kw) -> tuple[str, list]:
        chunks = list(self.chat(messages, stream=True, **kw))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        return sample(self.get("/metrics")[1], name, **labels)

    def healthy_encoders(self) -> int:
        try:
            return json.loads(self.get("/health")[1])["pools"]["encoder"]["healthy"]
        except OSError:
            return -1

    def output(self, chars: int | None = None) -> str:
        """The whole log by default: tests search it for what the proxy logged."""
        return super().output(chars)


def spawn_proxy(name: str, workdir: Path, args: list[str]) -> ProxyProc:
    port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "services.proxy", "--http-port", str(port), "--grpc-port", str(grpc_port), *args]
    log = workdir / f"{name}.log"
    env = {**clean_env(), "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    return ProxyProc(name, process, port, port, log, grpc_port=grpc_port)


def wait_healthy(proxy: ProxyProc, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proxy.process.poll() is not None:
            raise RuntimeError(f"{proxy.name} exited with {proxy.process.returncode}:\n{proxy.output()[-3000:]}")
        try:
            if proxy.get("/health")[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proxy.name} did not get healthy in {timeout_s:g} s:\n{proxy.output()[-3000:]}")
        time.sleep(0.1)


@dataclass
class Rig:
    cluster: LocalCluster
    main: ProxyProc  # the cluster's proxy: 60 s deadline, http image URLs on, probes every 0.2 s
    retry: ProxyProc  # encoder-0,encoder-1; 4 s deadline, 1 retry, no probes after start
    invalid: ProxyProc  # bad-encoder,encoder-1
    failover: ProxyProc  # encoder-0,encoder-1; no probes after start
    bad_encoder: ServiceProcess  # other max_pixels: other content keys

    def service(self, name: str) -> Service:
        return self.cluster.service(name)

    def encoders(self) -> list[Service]:
        return [s for s in self.cluster.pool("encoder-") if s.alive()]

    def metric(self, service: str, name: str, **labels: str) -> float:
        return sample(self.cluster.metrics(service), name, **labels)

    def encoder_metric(self, name: str, **labels: str) -> float:
        """Summed over the cluster's live encoders."""
        return sum(self.metric(s.name, name, **labels) for s in self.encoders())

    def wait_pools_idle(self, timeout_s: float = 10) -> float:
        """Until no sequence runs in the decode and the prefill waits for nothing and holds no KV."""

        def idle() -> bool:
            return (
                self.metric("decode", "epd_decode_running_sequences") == 0
                and self.metric("prefill", "epd_prefill_waiting_requests") == 0
                and self.metric("prefill", "epd_prefill_held_handoffs") == 0
            )

        return wait_until(idle, timeout_s, "the pools did not go idle (a request was left running, waiting or held)")

    @contextlib.contextmanager
    def hung(self, *services: Service) -> Iterator[None]:
        """SIGSTOP the services; SIGCONT them afterwards and wait until the main proxy serves them again."""
        for s in services:
            s.process.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            for s in services:
                if s.alive():
                    s.process.send_signal(signal.SIGCONT)
            alive = len(self.encoders())
            wait_until(
                lambda: self.main.healthy_encoders() == alive, 15, "the main proxy did not see the encoders again"
            )


@pytest.fixture(scope="module")
def rig(tiny_checkpoint, tmp_path_factory) -> Iterator[Rig]:
    workdir = tmp_path_factory.mktemp("proxy-failures")
    # A copy of the checkpoint whose processor allows other sizes: its encoder computes other
    # content keys for the same pictures, so it refuses the proxy's keys (INVALID_ARGUMENT).
    other = workdir / "other-processor" / tiny_checkpoint.name
    shutil.copytree(tiny_checkpoint, other)
    config = json.loads((other / "preprocessor_config.json").read_text())
    config["max_pixels"] = config["size"]["longest_edge"] = 2 * config["max_pixels"]
    (other / "preprocessor_config.json").write_text(json.dumps(config))
    bad = spawn(
        "bad-encoder", "services.encoder", ["--checkpoint", str(other), "--ec-store", f"file://{workdir / 'bad-ec'}"],
        workdir,
    )  # fmt: skip
    cluster = LocalCluster(
        ClusterConfig(
            checkpoint=tiny_checkpoint,
            encoders=2,
            http_port=free_port(),
            workdir=workdir / "cluster",
            extra_proxy_args=(
                "--allow-http-image-urls", "--request-timeout-s", "60",
                "--health-interval-s", "0.2", "--replica-down-s", "0.5",
            ),
        )  # fmt: skip
    )
    proxies: list[ProxyProc] = []
    try:
        cluster.start()
        wait_serving([bad])
        enc0, enc1 = (s.address for s in cluster.pool("encoder-"))
        pools = [
            "--checkpoint", str(tiny_checkpoint), "--ec-store", cluster.ec_url,
            "--prefills", cluster.service("prefill").address, "--decodes", cluster.service("decode").address,
        ]  # fmt: skip
        quiet = ["--health-interval-s", "600"]  # probed once at start, then only calls mark replicas down
        proxies = [
            spawn_proxy(
                "retry", workdir,
                [*pools, *quiet, "--encoders", f"{enc0},{enc1}", "--request-timeout-s", str(RETRY_TIMEOUT_S),
                 "--encode-retries", "1"],
            ),
            spawn_proxy("invalid", workdir, [*pools, "--encoders", f"{bad.address},{enc1}"]),
            spawn_proxy("failover", workdir, [*pools, *quiet, "--encoders", f"{enc0},{enc1}"]),
        ]  # fmt: skip
        for proxy in proxies:
            wait_healthy(proxy)
        p = cluster.proxy
        main = ProxyProc("proxy", p.process, p.port, p.metrics_port, p.log, grpc_port=cluster.proxy_grpc_port)
        yield Rig(cluster, main, *proxies, bad_encoder=bad)
    finally:
        for s in cluster.services:
            if s.alive():
                s.process.send_signal(signal.SIGCONT)  # a stopped process would not act on SIGTERM
        codes = {proxy.name: proxy.stop() for proxy in proxies}
        cluster.stop()
        bad.stop()
    assert all(code == 0 for code in codes.values()), f"proxies did not exit 0 on SIGTERM: {codes}"


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_checkpoint))


FOXES = user("Tell me about foxes.")


@pytest.fixture(scope="module")
def foxes_text(rig) -> str:
    """The greedy text of FOXES (40 tokens): the reference the stop-string tests cut."""
    reply = rig.main.chat(FOXES, max_tokens=40, **GREEDY)
    assert reply.usage.completion_tokens == 40
    return reply.choices[0].message.content


# ------------------------------------------------------------------ the main proxy


def test_text_only_streamed_equals_non_streamed_and_never_contacts_encoders(rig):
    rig.wait_pools_idle()
    encodes = rig.encoder_metric("epd_encoder_requests_total")
    prompt_tokens = rig.metric("prefill", "epd_prefill_prompt_tokens_total")
    decodes = rig.metric("decode", "epd_decode_requests_total")
    reply = rig.main.chat(user("Hi"), max_tokens=24, **GREEDY)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 24 and reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 24
    text, chunks = rig.main.stream(user("Hi"), max_tokens=24, stream_options={"include_usage": True}, **GREEDY)
    assert text == reply.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    # The pools saw exactly these two requests: prompts in the prefill, two decode streams, no Encode.
    assert rig.metric("prefill", "epd_prefill_prompt_tokens_total") - prompt_tokens == 2 * reply.usage.prompt_tokens
    assert rig.metric("decode", "epd_decode_requests_total") - decodes == 2
    assert rig.encoder_metric("epd_encoder_requests_total") == encodes
    rig.wait_pools_idle(5)  # each decode pulled its KV and finished: nothing held or running


def _stop_string(text: str, start: int = 12) -> tuple[str, int]:
    """A 3-character printable stop string whose first occurrence in text is at or after start."""
    for at in range(start, len(text) - 3):
        stop = text[at : at + 3]
        if stop.isascii() and stop.isprintable() and stop.strip() and text.find(stop) == at:
            return stop, at
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_ends_the_request_and_cancels_the_decode_stream(rig, foxes_text):
    stop, at = _stop_string(foxes_text)
    rig.wait_pools_idle()
    for streamed in (False, True):
        decodes = rig.metric("decode", "epd_decode_requests_total")
        generated = rig.metric("decode", "epd_decode_generated_tokens_total")
        began = time.monotonic()
        params = {"max_tokens": LONG, "stop": [stop, "zzqx-never"], **GREEDY}
        if streamed:
            text, chunks = rig.main.stream(FOXES, stream_options={"include_usage": True}, **params)
            finish, usage = [c.choices[0].finish_reason for c in chunks if c.choices][-1], chunks[-1].usage
        else:
            reply = rig.main.chat(FOXES, **params)
            text, finish, usage = reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage
        assert text == foxes_text[:at], (streamed, stop)
        assert finish == "stop"
        assert usage.completion_tokens <= 40  # the stop is inside the first 40 tokens
        assert rig.metric("decode", "epd_decode_requests_total") - decodes == 1  # it did reach the decode
        # Left alone the decode would run for LONG tokens (over ten seconds): the proxy cancelled it.
        wait_until(lambda: rig.metric("decode", "epd_decode_running_sequences") == 0, 3, "decode still running")
        assert time.monotonic() - began < 8
        assert rig.metric("decode", "epd_decode_generated_tokens_total") - generated < 200
    rig.wait_pools_idle(5)


def test_prefill_that_finishes_needs_no_decode(rig, foxes_text):
    rig.wait_pools_idle()
    decodes = rig.metric("decode", "epd_decode_requests_total")
    prefills = rig.metric("prefill", "epd_prefill_requests_total")
    reply = rig.main.chat(FOXES, max_tokens=1, **GREEDY)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 1
    assert foxes_text.startswith(reply.choices[0].message.content)
    assert rig.metric("prefill", "epd_prefill_requests_total") - prefills == 1
    assert rig.metric("decode", "epd_decode_requests_total") == decodes  # no decode, no KV handoff
    assert rig.metric("prefill", "epd_prefill_held_handoffs") == 0


def test_grpc_generate_matches_http(rig, tokenizer):
    image = picture(51)
    content = [epd_pb2.ContentPart(image=epd_pb2.ImageInput(data=image)), epd_pb2.ContentPart(text="what?")]
    request = epd_pb2.GenerateRequest(
        model=MODEL, messages=[epd_pb2.ChatMessage(role="user", content=content)], max_tokens=16, temperature=0.0,
        stop=["zzqx-never"],
    )  # fmt: skip
    with grpc.insecure_channel(f"127.0.0.1:{rig.main.grpc_port}") as channel:
        replies = list(epd_pb2_grpc.FrontendStub(channel).Generate(request, timeout=60))
    http_reply = rig.main.chat(user(image_part(image), "what?"), max_tokens=16, temperature=0.0, stop=["zzqx-never"])
    text = "".join(r.text for r in replies)
    assert text == http_reply.choices[0].message.content and text
    assert replies[-1].finished and replies[-1].finish_reason == http_reply.choices[0].finish_reason
    assert replies[-1].usage.completion_tokens == http_reply.usage.completion_tokens
    assert replies[-1].usage.prompt_tokens == http_reply.usage.prompt_tokens
    tokens = [t for r in replies for t in r.token_ids]
    assert len(tokens) == http_reply.usage.completion_tokens
    assert tokenizer.decode(tokens, skip_special_tokens=True) == text


def test_images_single_flight_and_ec_counters(rig):
    """Two requests with the same new image while the encoders hang: it is encoded once."""
    shared, other = picture(11, 90, 60), picture(12, 70, 70)
    rig.wait_pools_idle()
    hits, misses = rig.main.metric("epd_proxy_ec_hits_total"), rig.main.metric("epd_proxy_ec_misses_total")
    images = rig.main.metric("epd_proxy_images_total")
    encodes = rig.encoder_metric("epd_encoder_requests_total")
    encoded = rig.encoder_metric("epd_encoder_items_total", result="encoded")
    cached = rig.encoder_metric("epd_encoder_items_total", result="cached")
    waiting = lambda: rig.metric("prefill", "epd_prefill_waiting_requests")  # noqa: E731
    first_messages = user(image_part(shared), "a?")
    with ThreadPoolExecutor(2) as pool:
        with rig.hung(*rig.encoders()):  # both Encode calls wait unanswered until SIGCONT
            first = pool.submit(rig.main.chat, first_messages, max_tokens=8, temperature=0.0)
            wait_until(lambda: waiting() >= 1, 10, "the first request's prefill did not start waiting", 0.02)
            second = pool.submit(rig.main.chat, user(image_part(shared), image_part(other), "b?"), max_tokens=8)
            wait_until(lambda: waiting() >= 2, 10, "the second request's prefill did not start waiting", 0.02)
            time.sleep(0.2)
        replies = [first.result(30), second.result(30)]
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)
    assert rig.encoder_metric("epd_encoder_items_total", result="encoded") - encoded == 2  # shared once, other once
    assert rig.encoder_metric("epd_encoder_items_total", result="cached") == cached
    assert rig.encoder_metric("epd_encoder_requests_total") - encodes == 2
    assert rig.main.metric("epd_proxy_images_total") - images == 3
    assert rig.main.metric("epd_proxy_ec_misses_total") - misses == 3  # waiting on an in-flight encode is a miss
    assert rig.main.metric("epd_proxy_ec_hits_total") == hits
    third = rig.main.chat(first_messages, max_tokens=8, temperature=0.0)  # now it is in the EC store
    assert rig.main.metric("epd_proxy_ec_hits_total") - hits == 1
    assert rig.main.metric("epd_proxy_ec_misses_total") - misses == 3
    assert rig.encoder_metric("epd_encoder_requests_total") - encodes == 2
    assert third.choices[0].message.content == replies[0].choices[0].message.content
    rig.wait_pools_idle(5)


class _PictureServer:
    """An HTTP server on loopback with one picture at /cat.png (404 elsewhere)."""

    def __init__(self, body: bytes) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path != "/cat.png":
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/cat.png"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_http_image_urls_when_enabled(rig):
    image = picture(81, 80, 60)
    server = _PictureServer(image)
    try:
        encoded = rig.encoder_metric("epd_encoder_items_total", result="encoded")
        misses, images = rig.main.metric("epd_proxy_ec_misses_total"), rig.main.metric("epd_proxy_images_total")
        by_url = {"type": "image_url", "image_url": {"url": server.url}}
        reply = rig.main.chat(user(by_url, image_part(image), "same?"), max_tokens=8, temperature=0.0)
        assert reply.choices[0].finish_reason in ("stop", "length")
        # The fetched file and the data URL are the same picture: one key, encoded once.
        assert rig.encoder_metric("epd_encoder_items_total", result="encoded") - encoded == 1
        assert rig.main.metric("epd_proxy_ec_misses_total") - misses == 1
        assert rig.main.metric("epd_proxy_images_total") - images == 2
        inline = rig.main.chat(user(image_part(image), image_part(image), "same?"), max_tokens=8, temperature=0.0)
        assert inline.choices[0].message.content == reply.choices[0].message.content
        assert inline.usage.prompt_tokens == reply.usage.prompt_tokens
        missing = {"type": "image_url", "image_url": {"url": server.url + ".missing"}}
        with pytest.raises(openai.BadRequestError, match="returned HTTP 404"):
            rig.main.chat(user(missing), max_tokens=8)
    finally:
        server.close()


def test_client_going_away_cancels_the_decode_and_releases_the_kv(rig):
    rig.wait_pools_idle()
    generated = rig.metric("decode", "epd_decode_generated_tokens_total")
    body = {"model": MODEL, "messages": user("Hi"), "stream": True, "max_tokens": LONG, "temperature": 0.0}
    body = json.dumps({**body, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", rig.main.port)) as sock:
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while received.count(b"chat.completion.chunk") < 4:  # role, the prefill's token, decode chunks
            data = sock.recv(65536)
            assert data, "the proxy closed the stream"
            received += data
        assert rig.metric("decode", "epd_decode_running_sequences") == 1
    # LONG tokens would take the decode over ten seconds: it was cancelled instead.
    rig.wait_pools_idle(5)
    assert rig.metric("decode", "epd_decode_generated_tokens_total") - generated < LONG // 2


# ------------------------------------------------------------------ the `retry` proxy: hangs and deadlines


def test_hung_encoder_attempt_times_out_and_is_retried_on_the_other(rig):
    """First images through `retry`: its first Encode goes to encoder-0, which is stopped."""
    enc0, enc1 = rig.service("encoder-0"), rig.service("encoder-1")
    image = picture(61)
    messages = user(image_part(image), "hm?")
    before = rig.metric("encoder-1", "epd_encoder_requests_total")
    with rig.hung(enc0):
        began = time.monotonic()
        reply = rig.retry.chat(messages, max_tokens=8, temperature=0.0)
        took = time.monotonic() - began
    # The first attempt got half the 4 s deadline (one retry left), then the other replica answered.
    assert RETRY_TIMEOUT_S / 2 - 0.5 < took < RETRY_TIMEOUT_S, took
    assert f"encode attempt 1/2 failed: encode failed: DEADLINE_EXCEEDED from {enc0.address}" in rig.retry.output()
    assert rig.metric("encoder-1", "epd_encoder_requests_total") - before == 1
    assert (
        reply.choices[0].message.content
        == rig.main.chat(messages, max_tokens=8, temperature=0.0).choices[0].message.content
    )
    rig.wait_pools_idle(5)

    # Every encoder hangs: the request ends with 504 within its deadline (before any token, streamed too).
    errors = rig.retry.metric("epd_proxy_requests_total", status="error")
    with rig.hung(enc0, enc1):
        began = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            rig.retry.chat(user(image_part(picture(62)), "hm?"), max_tokens=8, stream=True)
        took = time.monotonic() - began
        assert info.value.status_code == 504, info.value.message
        assert "DEADLINE_EXCEEDED" in info.value.message and info.value.body["type"] == "server_error"
        assert took < RETRY_TIMEOUT_S + 1, took
        # The prefill that waited for the embeddings was cancelled with the request.
        wait_until(lambda: rig.metric("prefill", "epd_prefill_waiting_requests") == 0, 5, "the prefill still waits")
    assert rig.retry.metric("epd_proxy_requests_total", status="error") - errors == 1


def _sse_events(proxy: ProxyProc, body: dict) -> tuple[int, list[str]]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode()
    finally:
        conn.close()
    return resp.status, [line[len("data: ") :] for line in raw.split("\n") if line.startswith("data: ")]


def test_deadline_ends_a_long_request_with_504_or_an_sse_error(rig):
    rig.wait_pools_idle()
    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        rig.retry.chat(user("Hi"), max_tokens=LONG, **GREEDY)
    took = time.monotonic() - began
    assert info.value.status_code == 504
    assert "decode failed: DEADLINE_EXCEEDED" in info.value.message
    assert RETRY_TIMEOUT_S - 0.5 < took < RETRY_TIMEOUT_S + 2, took
    rig.wait_pools_idle(5)  # the decode stream ended with the deadline

    body = {"model": MODEL, "messages": user("Hi"), "max_tokens": LONG, "temperature": 0.0, "ignore_eos": True}
    began = time.monotonic()
    status, events = _sse_events(rig.retry, {**body, "stream": True})
    assert status == 200 and time.monotonic() - began < RETRY_TIMEOUT_S + 2
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "DEADLINE_EXCEEDED" in error["message"] and error["code"] == "deadline_exceeded"
    contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-2]]
    assert sum(bool(c) for c in contents) > 10  # tokens streamed before the deadline
    with pytest.raises(openai.APIError, match="DEADLINE_EXCEEDED"):
        rig.retry.stream(user("Hi"), max_tokens=LONG, **GREEDY)
    rig.wait_pools_idle(5)


# ------------------------------------------------------------------ the `invalid` proxy


def test_invalid_argument_from_encoder_is_not_retried(rig):
    """First images through `invalid`: its first Encode goes to the encoder with other content keys."""
    bad_before = rig.bad_encoder.metric("epd_encoder_requests_total")
    good_before = rig.metric("encoder-1", "epd_encoder_requests_total")
    began = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        rig.invalid.chat(user(image_part(picture(41)), "?"), max_tokens=8)
    assert time.monotonic() - began < 5
    message = info.value.body["message"]
    assert message.startswith(f"encode failed: INVALID_ARGUMENT from {rig.bad_encoder.address}: item 0: key ")
    assert "is not the content key of its image" in message
    assert info.value.body["type"] == "invalid_request_error"
    assert rig.bad_encoder.metric("epd_encoder_requests_total") - bad_before == 1
    assert rig.metric("encoder-1", "epd_encoder_requests_total") == good_before  # not retried there
    rig.wait_pools_idle(5)  # the prefill sent alongside was cancelled


# ------------------------------------------------------------------ the `failover` proxy: encoders die (last)


def test_dead_encoder_is_retried_on_the_other_replica(rig):
    """First images through `failover`: its first Encode goes to encoder-0, which was killed.
    Leaves encoder-0 dead."""
    victim, survivor = rig.service("encoder-0"), rig.service("encoder-1")
    before = rig.metric("encoder-1", "epd_encoder_requests_total")
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait(10)
    messages = user(image_part(picture(21, 50, 80)), "hm?")
    reply = rig.failover.chat(messages, max_tokens=8, temperature=0.0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert f"encode attempt 1/3 failed: encode failed: UNAVAILABLE from {victim.address}" in rig.failover.output()
    assert rig.metric(survivor.name, "epd_encoder_requests_total") - before == 1
    again = rig.main.chat(messages, max_tokens=8, temperature=0.0)  # an EC hit now
    assert again.choices[0].message.content == reply.choices[0].message.content


def test_encode_failing_everywhere_gives_503_and_cancels_the_prefill(rig):
    """Kills every encoder of the cluster while an image request's prefill waits for its embeddings."""
    encoders = rig.encoders()
    assert encoders
    errors = rig.failover.metric("epd_proxy_requests_total", status="error")
    rig.wait_pools_idle()
    with ThreadPoolExecutor(1) as pool:
        try:
            for s in encoders:
                s.process.send_signal(signal.SIGSTOP)  # the Encode waits there, unanswered
            pending = pool.submit(rig.failover.chat, user(image_part(picture(31)), "?"), max_tokens=8)
            waiting = lambda: rig.metric("prefill", "epd_prefill_waiting_requests")  # noqa: E731
            wait_until(lambda: waiting() == 1, 10, "the prefill did not wait for the embeddings")
        finally:
            for s in encoders:
                s.process.send_signal(signal.SIGKILL)
            for s in encoders:
                s.process.wait(10)
        killed = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            pending.result(30)
    assert time.monotonic() - killed < 5
    assert info.value.status_code == 503
    body = info.value.body
    assert body["type"] == "server_error" and body["code"] == "unavailable"
    assert body["message"].startswith("encode failed: UNAVAILABLE from 127.0.0.1:")
    # The prefill is not left waiting for embeddings that will never come (its own timeout is 30 s).
    rig.wait_pools_idle(5)
    assert rig.failover.metric("epd_proxy_requests_total", status="error") - errors == 1
    text = rig.failover.chat(user("Still there?"), max_tokens=4, **GREEDY)  # text-only still works
    assert text.usage.completion_tokens == 4


def test_graceful_shutdown_lets_in_flight_requests_finish(rig):
    """Last in the module: stops the `invalid` proxy."""
    proxy = rig.invalid
    rig.wait_pools_idle()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(proxy.chat, user("Hi"), max_tokens=600, **GREEDY)  # about 3 s of decode
        wait_until(lambda: rig.metric("decode", "epd_decode_running_sequences") == 1, 10, "no decode started")
        proxy.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(openai.APIConnectionError):  # draining: no new requests
            proxy.chat(user("Hi"), max_tokens=4)
        assert not pending.done()
        reply = pending.result(30)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 600
    assert proxy.process.wait(30) == 0
    rig.wait_pools_idle(5)
