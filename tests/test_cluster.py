"""The whole cluster as real processes on loopback, driven with the official `openai` client.

Two encoder replicas, one prefill, one decode and the proxy, with the filesystem EC store
and with Redis. Outputs are compared token for token (through the text) with HF `generate`.
"""

import asyncio
import base64
import io
import re
import signal
import time

import grpc
import openai
import pytest

from services.cluster import ClusterConfig, LocalCluster, free_port
from services.rpc import epd_pb2, epd_pb2_grpc
from tests.conftest import make_image
from tests.hf_reference import HFReference, template_messages

MAX_TOKENS = 32
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(image, fmt="PNG"):
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return {"type": "image_url", "image_url": {"url": data_url(buf.getvalue(), f"image/{fmt.lower()}")}}


def user(*parts):
    """One user message: a plain string, or content parts."""
    content = parts[0] if len(parts) == 1 and isinstance(parts[0], str) else list(parts)
    return [{"role": "user", "content": content}]


def text(t):
    return {"type": "text", "text": t}


ONE = make_image(150, 110, 4)
THREE = [make_image(260, 70, 1), make_image(64, 180, 2), make_image(300, 250, 3)]
REQUESTS = {
    "text-only": (user("Tell me a story about a red fox."), []),
    "one-image": (user(image_part(ONE), text("What is in this picture?")), [ONE]),
    "three-images": (user(*(image_part(im) for im in THREE), text("Compare them.")), THREE),
}


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return HFReference(tiny_checkpoint)


@pytest.fixture(scope="module")
def expected(reference):
    """HF greedy text and tokens for each request."""
    out = {}
    for name, (messages, images) in REQUESTS.items():
        tokens = reference.generate(template_messages(messages), images, MAX_TOKENS)
        out[name] = (tokens, reference.tokenizer.decode(tokens, skip_special_tokens=True))
    return out


@pytest.fixture(scope="module", params=["fs", "redis"])
def cluster(request, tiny_checkpoint, tmp_path_factory):
    config = ClusterConfig(
        checkpoint=tiny_checkpoint,
        ec=request.param,
        encoders=2,
        http_port=free_port(),
        workdir=tmp_path_factory.mktemp(f"cluster-{request.param}"),
        extra_proxy_args=("--request-timeout-s", "60"),
    )
    with LocalCluster(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120)


def counter(metrics_text: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name)}{re.escape(labels)}\s+([0-9.e+-]+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, metrics_text, re.M))


def encoder_total(cluster, name, labels=""):
    return sum(counter(cluster.metrics(s.name), name, labels) for s in cluster.pool("encoder-") if s.alive())


def chat(client, cluster, messages, **params):
    return client.chat.completions.create(model=cluster.model_name, messages=messages, **{**GREEDY, **params})


def stream_text(client, cluster, messages, **params):
    chunks = chat(client, cluster, messages, stream=True, **params)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# Order matters within a cluster: text-only traffic first, while the encoders are untouched.
def test_text_only_requests_never_reach_the_encoders(client, cluster, expected):
    for _ in range(2):
        reply = chat(client, cluster, REQUESTS["text-only"][0])
        assert reply.choices[0].message.content == expected["text-only"][1]
    assert stream_text(client, cluster, REQUESTS["text-only"][0]) == expected["text-only"][1]
    assert encoder_total(cluster, "epd_encoder_requests_total") == 0


@pytest.mark.parametrize("name", list(REQUESTS))
def test_outputs_equal_hf_generate_streamed_and_not(client, cluster, expected, name):
    messages, _ = REQUESTS[name]
    reply = chat(client, cluster, messages)
    assert reply.choices[0].message.content == expected[name][1]
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == MAX_TOKENS
    assert reply.usage.prompt_tokens > 0
    assert stream_text(client, cluster, messages) == expected[name][1]


@pytest.mark.parametrize("name", list(REQUESTS))
def test_grpc_front_door_gives_the_same_tokens(cluster, expected, name):
    messages, _ = REQUESTS[name]
    request = epd_pb2.GenerateRequest(model=cluster.model_name, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for m in messages:
        content = m["content"] if isinstance(m["content"], list) else [text(m["content"])]
        parts = [
            (
                epd_pb2.ContentPart(text=p["text"])
                if p["type"] == "text"
                else epd_pb2.ContentPart(image=epd_pb2.ImageInput(url=p["image_url"]["url"]))
            )
            for p in content
        ]
        request.messages.append(epd_pb2.ChatMessage(role=m["role"], content=parts))
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        replies = list(epd_pb2_grpc.FrontendStub(channel).Generate(request, timeout=120))
    assert [t for r in replies for t in r.token_ids] == expected[name][0]
    assert "".join(r.text for r in replies) == expected[name][1]
    assert replies[-1].finished and replies[-1].finish_reason == "length"
    assert replies[-1].usage.completion_tokens == MAX_TOKENS


def test_a_repeated_image_is_encoded_once(client, cluster):
    picture = make_image(120, 96, 30)
    question = text("Describe it.")
    before = encoder_total(cluster, "epd_encoder_items_total", '{result="encoded"}')
    first = chat(client, cluster, user(image_part(picture, "PNG"), question))
    second = chat(client, cluster, user(image_part(picture, "BMP"), question))  # same pixels, other file
    assert encoder_total(cluster, "epd_encoder_items_total", '{result="encoded"}') - before == 1
    assert first.choices[0].message.content == second.choices[0].message.content


def test_32_concurrent_mixed_requests_each_give_their_alone_output(cluster, reference):
    images = [make_image(90 + 20 * i, 120 - 10 * i, 40 + i) for i in range(4)]
    distinct = [user(f"Say something about number {i}.") for i in range(4)]
    distinct += [user(image_part(im), text(f"Picture {i}?")) for i, im in enumerate(images)]
    alone = []
    for i, messages in enumerate(distinct):
        pics = [images[i - 4]] if i >= 4 else []
        tokens = reference.generate(template_messages(messages), pics, 16)
        alone.append(reference.tokenizer.decode(tokens, skip_special_tokens=True))

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=300)
        jobs = [
            aclient.chat.completions.create(
                model=cluster.model_name, messages=distinct[i % 8], temperature=0.0, max_tokens=16,
                extra_body={"ignore_eos": True},
            )
            for i in range(32)
        ]  # fmt: skip
        return await asyncio.gather(*jobs)

    replies = asyncio.run(run_all())
    assert [r.choices[0].message.content for r in replies] == [alone[i % 8] for i in range(32)]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]}, "unsupported content part"),
        ({"messages": user({"type": "image_url", "image_url": {"url": data_url(b"nope")}})}, "image"),
        ({"messages": user("hi"), "temperature": 7}, "temperature"),
        ({"messages": user("hi"), "max_tokens": 5000}, "context length"),
    ],
)  # fmt: skip
def test_bad_input_gets_a_400_and_the_cluster_keeps_serving(client, cluster, expected, body, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=cluster.model_name, **body)
    assert message in str(err.value.body["message"])
    with pytest.raises(openai.BadRequestError, match="model"):
        client.chat.completions.create(model="no-such-model", messages=user("hi"))
    reply = chat(client, cluster, REQUESTS["text-only"][0])
    assert reply.choices[0].message.content == expected["text-only"][1]


def test_killing_an_encoder_mid_run_loses_nothing(cluster, reference):
    """Last in the module: it leaves one encoder dead."""
    images = [make_image(200 + 10 * i, 150, 70 + i) for i in range(6)]
    question = text("What do you see?")

    async def one(aclient, image):
        started = time.monotonic()
        try:
            reply = await aclient.chat.completions.create(
                model=cluster.model_name, messages=user(image_part(image), question), temperature=0.0, max_tokens=8,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return reply.choices[0].message.content, None, time.monotonic() - started
        except openai.APIStatusError as exc:
            return None, exc, time.monotonic() - started

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120)
        tasks = [asyncio.create_task(one(aclient, im)) for im in images]
        await asyncio.sleep(0.3)
        cluster.service("encoder-0").process.send_signal(signal.SIGKILL)
        return await asyncio.gather(*tasks)

    results = asyncio.run(run_all())
    for image, (content, error, seconds) in zip(images, results):
        assert seconds < 90  # nothing hangs: it finishes or fails within its deadline
        if error is None:
            tokens = reference.generate(template_messages(user({"type": "image"}, question)), [image], 8)
            assert content == reference.tokenizer.decode(tokens, skip_special_tokens=True)
        else:
            assert error.status_code in (502, 503, 504) and error.body["message"]
    assert any(error is None for _, error, _ in results)
    later = make_image(111, 77, 99)
    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=cluster.model_name, messages=user(image_part(later), question), temperature=0.0, max_tokens=8
    )
    assert reply.choices[0].message.content
