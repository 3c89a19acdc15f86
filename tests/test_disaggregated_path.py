"""The in-process E -> P -> D path against Hugging Face `generate` on the same checkpoint."""

import pytest

from connectors.ec import FilesystemECStore, RedisECStore
from services.disaggregated import InProcessEPD
from services.engine.config import EngineConfig
from services.engine.sequence import FinishReason, SamplingParams
from tests.conftest import make_image, png_bytes
from tests.hf_reference import HFReference, template_messages

MAX_NEW = 40
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def image_part(image):
    return {"type": "image", "image": image}


def text_part(text):
    return {"type": "text", "text": text}


def cases():
    wide, tall, square = make_image(260, 70, 1), make_image(64, 180, 2), make_image(300, 250, 3)
    one = make_image(150, 110, 4)
    return {
        "text-only": ([{"role": "user", "content": "Tell me a story about a red fox."}], []),
        "one-image": ([{"role": "user", "content": [image_part(one), text_part("What is in this picture?")]}], [one]),
        "three-images": (
            [
                {
                    "role": "user",
                    "content": [image_part(wide), image_part(tall), image_part(square), text_part("Compare them.")],
                }
            ],
            [wide, tall, square],
        ),
        "image-in-middle": (
            [
                {"role": "system", "content": "You describe images."},
                {
                    "role": "user",
                    "content": [text_part("Look at this:"), image_part(one), text_part("and say what you see.")],
                },
            ],
            [one],
        ),
    }


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return HFReference(tiny_checkpoint)


@pytest.fixture(scope="module", params=["fs", "redis"])
def epd(request, tiny_checkpoint, tmp_path_factory):
    if request.param == "fs":
        store = FilesystemECStore(tmp_path_factory.mktemp("ec"), max_bytes=1 << 30)
    else:
        store = RedisECStore(request.getfixturevalue("redis_url"), prefix="epd:test-path:")
    yield InProcessEPD(tiny_checkpoint, store, EngineConfig(block_size=8, num_blocks=256))
    store.close()


@pytest.mark.parametrize("case", list(cases()))
def test_greedy_tokens_equal_hf_generate(epd, reference, case):
    messages, images = cases()[case]
    expected = reference.generate(template_messages(messages), images, MAX_NEW)
    [got] = epd.generate([(messages, GREEDY)])
    assert got.error is None
    assert len(got.token_ids) == MAX_NEW
    assert got.token_ids == expected


def test_prompt_ids_equal_hf_processing(epd, reference):
    for messages, images in cases().values():
        ours = epd.prompts.build(messages)
        theirs = reference.inputs(template_messages(messages), images)["input_ids"][0].tolist()
        assert ours.token_ids == theirs


def test_images_change_the_output(epd):
    question = text_part("What is in this picture?")
    outputs = [
        epd.generate([([{"role": "user", "content": [image_part(make_image(150, 110, seed)), question]}], GREEDY)])[0]
        for seed in (10, 11)
    ]
    assert outputs[0].token_ids != outputs[1].token_ids


def test_same_image_as_png_bytes_is_encoded_once(epd):
    image = make_image(120, 90, 20)
    messages = [{"role": "user", "content": [image_part(image), text_part("Again?")]}]
    as_bytes = [{"role": "user", "content": [{"type": "image", "image": png_bytes(image)}, text_part("Again?")]}]
    first = epd.generate([(messages, GREEDY)])[0]
    key = epd.prompts.build(messages).features[0].key
    assert epd.store.exists(key)
    metas = epd.encoder.encode_and_publish([image])
    assert metas[0].cached and metas[0].key == key
    assert epd.generate([(as_bytes, GREEDY)])[0].token_ids == first.token_ids


def test_eos_stops_like_hf(epd, reference):
    messages, images = cases()["one-image"]
    expected = reference.generate(template_messages(messages), images, MAX_NEW, stop_at_eos=True)
    [got] = epd.generate([(messages, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))])
    assert got.token_ids == expected
    stopped = got.token_ids[-1] in reference.model.generation_config.eos_token_id
    assert got.finish_reason == (FinishReason.STOP if stopped else FinishReason.LENGTH)


def test_stop_token_ids_and_max_tokens(epd):
    messages, _ = cases()["text-only"]
    [full] = epd.generate([(messages, GREEDY)])
    stop_at = full.token_ids[5]
    first_index = full.token_ids.index(stop_at)
    [stopped] = epd.generate(
        [(messages, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=(stop_at,), ignore_eos=True))]
    )
    assert stopped.token_ids == full.token_ids[: first_index + 1]
    assert stopped.finish_reason is FinishReason.STOP
    [short] = epd.generate([(messages, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))])
    assert short.token_ids == full.token_ids[:3] and short.finish_reason is FinishReason.LENGTH


def test_all_blocks_return_to_both_pools(epd):
    requests = [(msgs, GREEDY) for msgs, _ in cases().values()]
    epd.generate(requests)
    for engine in (epd.prefill.engine, epd.decode.engine):
        assert engine.blocks.num_free == engine.blocks.num_blocks
        assert engine.blocks.reserved == 0
        assert not engine.seqs
