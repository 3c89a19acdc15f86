"""The encoder, prefill, decode and PD services as real processes on loopback.

Real gRPC, a real redis-server (and a filesystem store), metrics read from the
/metrics endpoints. Tokens are compared with an in-process LLMEngine(role="both").
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2

from connectors.ec import FilesystemECStore, open_ec_store
from services.common.flags import build_settings
from services.common.settings import DecodeSettings
from services.encoder.stage import EncoderStage
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sequence import SamplingParams
from services.multimodal.prompt import ChatPrompt, PromptBuilder
from services.rpc import epd_pb2, epd_pb2_grpc
from tests.conftest import make_image, png_bytes
from tests.pool_procs import REPO_ROOT, ServiceProcess, clean_env, free_port, spawn, wait_for, wait_serving

MAX_NEW = 24
SERVING = health_pb2.HealthCheckResponse.SERVING


# ------------------------------------------------------------------ fixtures


@dataclass
class Pool:
    encoder: ServiceProcess
    prefill: ServiceProcess  # Redis EC store, long timeouts
    prefill_short: ServiceProcess  # filesystem EC store, 1 s feature and KV-hold timeouts
    decode: ServiceProcess
    pd: ServiceProcess
    spare_decode: ServiceProcess  # the graceful-shutdown test stops it
    ec_url: str


@pytest.fixture(scope="module")
def pool(tiny_checkpoint, redis_url, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("pool")
    ec_url = redis_url.rsplit("/", 1)[0] + "/3"  # a database of its own
    redis.Redis.from_url(ec_url).flushdb()
    model = ["--checkpoint", str(tiny_checkpoint)]
    lm = [*model, "--num-blocks", "256"]
    fs_store = f"file://{workdir / 'ec-fs'}"
    short = ["--feature-timeout-s", "1", "--kv-hold-timeout-s", "1"]
    services = [
        spawn("encoder", "services.encoder", [*model, "--ec-store", ec_url, "--batch-wait-ms", "100"], workdir),
        spawn("prefill", "services.prefill", [*lm, "--ec-store", ec_url, "--kv-chunk-bytes", "4096"], workdir),
        spawn("prefill-short", "services.prefill", [*lm, "--ec-store", fs_store, *short], workdir),
        spawn("decode", "services.decode", [*model, "--block-size", "8"], workdir),
        spawn("pd", "services.pd", [*lm, "--ec-store", ec_url], workdir),
        spawn("spare-decode", "services.decode", [*lm, "--grace-s", "30"], workdir),
    ]
    try:
        wait_serving(services)
        yield Pool(*services, ec_url=ec_url)
    finally:
        for service in services:
            service.terminate()
        codes = {s.name: s.stop() for s in services}
    bad = {name: code for name, code in codes.items() if code != 0}
    assert not bad, f"services did not exit 0 on SIGTERM: {bad}\n" + "\n".join(
        services[[s.name for s in services].index(n)].output() for n in bad
    )


class Reference:
    """Greedy tokens from an in-process encoder + LLMEngine(role="both"), with a private store."""

    def __init__(self, checkpoint: Path, store_dir: Path) -> None:
        store = FilesystemECStore(store_dir, max_bytes=1 << 30)
        self.encoder = EncoderStage(checkpoint, store)
        self.engine = LLMEngine(checkpoint, EngineConfig(role="both", num_blocks=256), store)
        self.prompts = PromptBuilder(checkpoint, self.encoder.processor, self.encoder.model_id)

    def tokens(self, prompt: ChatPrompt, max_tokens: int = MAX_NEW) -> list[int]:
        if prompt.images:
            self.encoder.encode_and_publish(prompt.images)
        request_id = uuid.uuid4().hex
        self.engine.add_request(request_id, prompt.token_ids, greedy(max_tokens), prompt.features)
        out: list[int] = []
        while self.engine.has_unfinished():
            out += [t for o in self.engine.step() if o.request_id == request_id for t in o.new_token_ids]
        return out


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, tmp_path_factory) -> Reference:
    return Reference(tiny_checkpoint, tmp_path_factory.mktemp("reference-ec"))


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def text_messages(text: str = "Tell me a story about a red fox.") -> list[dict]:
    return [{"role": "user", "content": text}]


def image_messages(*images) -> list[dict]:
    parts = [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is in this picture?"}]}]


# ------------------------------------------------------------------ clients


def encode(encoder: ServiceProcess, prompt: ChatPrompt) -> epd_pb2.EncodeResponse:
    items = [epd_pb2.EncodeItem(key=f.key, image=data) for f, data in zip(prompt.features, prompt.image_files)]
    with encoder.channel() as channel:
        return epd_pb2_grpc.EncoderStub(channel).Encode(epd_pb2.EncodeRequest(items=items), timeout=30)


def prefill_request(prompt: ChatPrompt, max_tokens: int = MAX_NEW) -> epd_pb2.PrefillRequest:
    features = [
        epd_pb2.FeatureSpec(key=f.key, offset=f.offset, length=f.length, grid_thw=f.grid_thw) for f in prompt.features
    ]
    sampling = epd_pb2.Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return epd_pb2.PrefillRequest(
        request_id=uuid.uuid4().hex, token_ids=prompt.token_ids, features=features, sampling=sampling
    )


def prefill(service: ServiceProcess, prompt: ChatPrompt, max_tokens: int = MAX_NEW) -> epd_pb2.PrefillResponse:
    with service.channel() as channel:
        return epd_pb2_grpc.PrefillStub(channel).Prefill(prefill_request(prompt, max_tokens), timeout=60)


def decode(service: ServiceProcess, kv: epd_pb2.KVHandle) -> list[epd_pb2.TokenChunk]:
    with service.channel() as channel:
        return list(epd_pb2_grpc.DecodeStub(channel).Decode(epd_pb2.DecodeRequest(request_id="r", kv=kv), timeout=60))


def generate(prefill_at: ServiceProcess, decode_at: ServiceProcess, prompt: ChatPrompt) -> list[int]:
    first = prefill(prefill_at, prompt)
    assert not first.finished and first.kv.address == prefill_at.address and first.kv.nbytes > 0
    chunks = decode(decode_at, first.kv)
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert not any(c.finished for c in chunks[:-1])
    return [first.first_token] + [t for c in chunks for t in c.token_ids]


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


# ------------------------------------------------------------------ health and flags


def test_every_service_reports_serving(pool):
    names = [
        (pool.encoder, ["epd.v1.Encoder"]),
        (pool.prefill, ["epd.v1.Prefill"]),
        (pool.decode, ["epd.v1.Decode"]),
        (pool.pd, ["epd.v1.Prefill", "epd.v1.Decode"]),
    ]
    for service, services in names:
        for name in ["", *services]:
            assert service.health(name) == SERVING, (service.name, name)


@pytest.mark.parametrize(
    "module, args, env, expected",
    [
        ("services.encoder", ["--checkpoint", "{missing}", "--port", "5000", "--ec-store", "/tmp/x"], {},
         "--checkpoint {missing}: no such directory; point it at a Hugging Face checkpoint directory"),
        ("services.prefill", ["--checkpoint", "{empty}", "--port", "5000", "--ec-store", "/tmp/x"], {},
         "no config.json there; point it at a Hugging Face checkpoint directory"),
        ("services.decode", ["--checkpoint", "{ckpt}", "--port", "70000"], {}, "--port 70000: ports are 1-65535"),
        ("services.pd", ["--checkpoint", "{ckpt}", "--port", "5000"], {"EPD_EC_STORE": "ftp://x"},
         "--ec-store ftp://x: must be file:///abs/path, a path, or redis://host:port/db"),
        ("services.encoder", ["--checkpoint", "{ckpt}", "--port", "5000", "--ec-store", "/tmp/x", "--ec-ttl-s", "9"],
         {}, "--ec-ttl-s works only with a redis:// EC store"),
        ("services.decode", ["--checkpoint", "{ckpt}"], {}, "--port is required (or set EPD_PORT)"),
    ],
)  # fmt: skip
def test_bad_flags_exit_2_with_the_fix(tiny_checkpoint, tmp_path, module, args, env, expected):
    paths = {"missing": tmp_path / "missing", "empty": tmp_path, "ckpt": tiny_checkpoint}
    args = [a.format(**paths) for a in args]
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        env={**clean_env(), **env},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert expected.format(**paths) in result.stderr


def test_flags_win_over_environment(tiny_checkpoint):
    given = {"checkpoint": str(tiny_checkpoint), "port": "7001"}
    env = {"EPD_PORT": "7002", "EPD_NUM_BLOCKS": "99", "EPD_GRACE_S": "1.5"}
    settings = build_settings(DecodeSettings, given, env)
    assert (settings.port, settings.num_blocks, settings.grace_s) == (7001, 99, 1.5)


# ------------------------------------------------------------------ encoder


def test_encoder_publishes_new_images_and_skips_cached_ones(pool, reference):
    seen, new_b, new_c = make_image(96, 64, 101), make_image(120, 80, 102), make_image(64, 150, 103)
    prompts = reference.prompts
    encoded = lambda: pool.encoder.metric("epd_encoder_items_total", result="encoded")  # noqa: E731
    before = encoded()
    assert [m.cached for m in encode(pool.encoder, prompts.build(image_messages(seen))).items] == [False]
    prompt = prompts.build(image_messages(new_b, new_c, seen))
    reply = encode(pool.encoder, prompt)
    assert [m.key for m in reply.items] == [f.key for f in prompt.features]
    assert [m.cached for m in reply.items] == [False, False, True]
    assert encoded() - before == 3
    twice = prompts.build(image_messages(make_image(80, 80, 104), make_image(80, 80, 104)))
    assert [m.cached for m in encode(pool.encoder, twice).items] == [False, False]
    assert encoded() - before == 4  # the image repeated within one request was encoded once
    with open_ec_store(pool.ec_url) as store:
        for meta, spec in zip(reply.items, prompt.features):
            entry = store.get(meta.key)
            assert entry is not None and entry.rows == meta.rows == spec.length and entry.width == meta.width
            assert list(meta.grid_thw) == list(spec.grid_thw)


def test_encoder_rejects_a_wrong_key(pool):
    image = png_bytes(make_image(64, 64, 110))
    request = epd_pb2.EncodeRequest(items=[epd_pb2.EncodeItem(key="0" * 64, image=image)])
    with pool.encoder.channel() as channel:
        error = rpc_error(lambda: epd_pb2_grpc.EncoderStub(channel).Encode(request, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "item 0" in error.details() and "is not the content key of its image" in error.details()


def test_concurrent_encode_calls_are_batched_and_share_a_key(pool, reference):
    images = [make_image(72, 72, 120), make_image(72, 72, 120), make_image(88, 64, 121), make_image(64, 88, 122)]
    prompts = [reference.prompts.build(image_messages(image)) for image in images]
    batches = lambda: pool.encoder.metric("epd_encoder_batch_items_count")  # noqa: E731
    encoded = lambda: pool.encoder.metric("epd_encoder_items_total", result="encoded")  # noqa: E731
    batches_before, encoded_before = batches(), encoded()
    with pool.encoder.channel() as channel:
        stub = epd_pb2_grpc.EncoderStub(channel)
        calls = []
        for prompt in prompts:
            item = epd_pb2.EncodeItem(key=prompt.features[0].key, image=prompt.image_files[0])
            calls.append(stub.Encode.future(epd_pb2.EncodeRequest(items=[item]), timeout=30))
        replies = [call.result() for call in calls]
    assert [r.items[0].key for r in replies] == [p.features[0].key for p in prompts]
    assert encoded() - encoded_before == 3  # the same image asked for twice at once is encoded once
    assert batches() - batches_before < 3  # so at least one batch held more than one item


# ------------------------------------------------------------------ prefill + decode over the network


@pytest.mark.parametrize("case", ["text", "one-image", "two-images"])
def test_prefill_then_decode_matches_the_engine(pool, reference, case):
    messages = {
        "text": text_messages(),
        "one-image": image_messages(make_image(150, 110, 4)),
        "two-images": image_messages(make_image(260, 70, 1), make_image(64, 180, 2)),
    }[case]
    prompt = reference.prompts.build(messages)
    if prompt.features:
        encode(pool.encoder, prompt)
    assert generate(pool.prefill, pool.decode, prompt) == reference.tokens(prompt)
    assert wait_for(lambda: pool.prefill.metric("epd_prefill_held_handoffs") == 0)
    assert pool.decode.metric("epd_decode_running_sequences") == 0
    assert pool.decode.metric("epd_decode_kv_pull_bytes_total") > 0


def test_prefill_waits_for_embeddings_without_blocking_other_prompts(pool, reference):
    prompt = reference.prompts.build(image_messages(make_image(130, 90, 301)))
    with pool.prefill.channel() as channel:
        stub = epd_pb2_grpc.PrefillStub(channel)
        waiting = stub.Prefill.future(prefill_request(prompt), timeout=60)
        assert wait_for(lambda: pool.prefill.metric("epd_prefill_waiting_requests") == 1)
        text = stub.Prefill(prefill_request(reference.prompts.build(text_messages("Hi")), max_tokens=1), timeout=30)
        assert text.finished and text.finish_reason == "length"
        assert not waiting.done()
        encode(pool.encoder, prompt)
        first = waiting.result()
    chunks = decode(pool.decode, first.kv)
    assert [first.first_token] + [t for c in chunks for t in c.token_ids] == reference.tokens(prompt)


def test_embeddings_that_never_arrive_end_in_deadline_exceeded(pool, reference):
    prompt = reference.prompts.build(image_messages(make_image(100, 100, 302)))
    error = rpc_error(lambda: prefill(pool.prefill_short, prompt))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert prompt.features[0].key in error.details()


def test_an_unreleased_handoff_is_freed_after_the_hold_timeout(pool, reference):
    first = prefill(pool.prefill_short, reference.prompts.build(text_messages("Hold this.")))
    assert pool.prefill_short.metric("epd_prefill_held_handoffs") == 1
    assert wait_for(lambda: pool.prefill_short.metric("epd_prefill_held_handoffs") == 0, timeout_s=10)
    with pool.prefill_short.channel() as channel:
        stub = epd_pb2_grpc.PrefillStub(channel)
        pull = epd_pb2.PullKVRequest(handoff_id=first.kv.handoff_id)
        error = rpc_error(lambda: list(stub.PullKV(pull, timeout=10)))
        assert error.code() == grpc.StatusCode.NOT_FOUND and "--kv-hold-timeout-s" in error.details()
        release = epd_pb2.ReleaseKVRequest(handoff_id=first.kv.handoff_id)
        assert rpc_error(lambda: stub.ReleaseKV(release, timeout=10)).code() == grpc.StatusCode.NOT_FOUND


def test_decode_reports_pull_failures(pool):
    missing = epd_pb2.KVHandle(address=pool.prefill.address, handoff_id="no-such-handoff", nbytes=10)
    error = rpc_error(lambda: decode(pool.decode, missing))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "no-such-handoff" in error.details()
    unreachable = epd_pb2.KVHandle(address=f"127.0.0.1:{free_port()}", handoff_id="h", nbytes=10)
    error = rpc_error(lambda: decode(pool.decode, unreachable))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and unreachable.address in error.details()


def test_invalid_prefill_requests_are_rejected(pool, reference):
    prompt = reference.prompts.build(text_messages())
    with pool.prefill.channel() as channel:
        stub = epd_pb2_grpc.PrefillStub(channel)
        too_big = prefill_request(prompt)
        too_big.token_ids.append(10**6)
        error = rpc_error(lambda: stub.Prefill(too_big, timeout=10))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "token ids must be in" in error.details()
        no_tokens = prefill_request(prompt, max_tokens=0)
        error = rpc_error(lambda: stub.Prefill(no_tokens, timeout=10))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in error.details()


def test_cancelling_a_decode_stream_aborts_the_request(pool, reference):
    first = prefill(pool.prefill, reference.prompts.build(text_messages("Go on.")), max_tokens=4000)
    with pool.decode.channel() as channel:
        call = epd_pb2_grpc.DecodeStub(channel).Decode(epd_pb2.DecodeRequest(request_id="c", kv=first.kv), timeout=60)
        next(call)
        assert pool.decode.metric("epd_decode_running_sequences") == 1
        call.cancel()
    # 4000 tokens take far longer than this wait: only an abort ends the sequence in time.
    assert wait_for(lambda: pool.decode.metric("epd_decode_running_sequences") == 0, timeout_s=3)


# ------------------------------------------------------------------ PD worker


@pytest.mark.parametrize("case", ["text", "one-image"])
def test_pd_worker_resumes_in_place(pool, reference, case):
    messages = {"text": text_messages(), "one-image": image_messages(make_image(150, 110, 4))}[case]
    prompt = reference.prompts.build(messages)
    if prompt.features:
        encode(pool.encoder, prompt)
    pulled_before = pool.pd.metric("epd_decode_kv_pull_bytes_total")
    assert generate(pool.pd, pool.pd, prompt) == reference.tokens(prompt)
    assert pool.pd.metric("epd_decode_kv_pull_bytes_total") == pulled_before  # no copy
    assert pool.pd.metric("epd_prefill_held_handoffs") == 0


def test_pd_worker_pulls_kv_held_elsewhere(pool, reference):
    prompt = reference.prompts.build(text_messages("Pull it over."))
    pulled_before = pool.pd.metric("epd_decode_kv_pull_bytes_total")
    assert generate(pool.prefill, pool.pd, prompt) == reference.tokens(prompt)
    assert pool.pd.metric("epd_decode_kv_pull_bytes_total") > pulled_before
    assert wait_for(lambda: pool.prefill.metric("epd_prefill_held_handoffs") == 0)


# ------------------------------------------------------------------ shutdown


def test_sigterm_lets_an_in_flight_decode_stream_finish(pool, reference):
    spare = pool.spare_decode
    first = prefill(pool.prefill, reference.prompts.build(text_messages("Keep going.")), max_tokens=800)
    with spare.channel() as channel:
        call = epd_pb2_grpc.DecodeStub(channel).Decode(epd_pb2.DecodeRequest(request_id="s", kv=first.kv), timeout=60)
        chunks = [next(call)]
        spare.terminate()
        assert wait_for(lambda: spare.health() != SERVING, timeout_s=5)  # draining: no new RPCs
        assert call.is_active()
        chunks += list(call)
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == 799
    assert spare.process.wait(timeout=30) == 0, spare.output()
