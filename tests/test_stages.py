"""Each stage loads only its own tensors; prefill waits for embeddings and fails clearly."""

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from connectors.ec import FilesystemECStore
from connectors.kv import KVHandoff, KVHandoffError
from services.decode.stage import DecodeStage
from services.encoder.stage import EncoderStage
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sequence import FeatureSpec, FinishReason, RequestError, SamplingParams
from services.models.checkpoint import CheckpointError, open_checkpoint
from services.multimodal.prompt import PromptBuilder
from services.prefill.stage import PrefillStage
from tests.conftest import make_image

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture()
def store(tmp_path):
    return FilesystemECStore(tmp_path / "ec", max_bytes=1 << 28)


@pytest.fixture(scope="module")
def encoder(tiny_checkpoint):
    return EncoderStage(open_checkpoint(tiny_checkpoint))


@pytest.fixture(scope="module")
def prompts(tiny_checkpoint, encoder):
    return PromptBuilder(tiny_checkpoint, encoder.processor, encoder.model_id)


def image_prompt(prompts, image):
    return prompts.build(
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hi"}]}]
    )


def run(stage):
    results = []
    while stage.has_unfinished():
        results.extend(stage.step())
    return results


def test_encoder_materializes_no_language_tensor(tiny_checkpoint):
    ckpt = open_checkpoint(tiny_checkpoint)
    stage = EncoderStage(ckpt)
    assert ckpt.loaded_names and all(n.startswith("visual.") for n in ckpt.loaded_names)
    assert not any(n.startswith(("model.", "lm_head.")) for n in ckpt.loaded_names)
    assert all(not n.startswith(("model.", "lm_head")) for n in stage.tower.state_dict())


def test_language_stages_materialize_no_vision_tensor(tiny_checkpoint):
    for role in ("prefill", "decode"):
        ckpt = open_checkpoint(tiny_checkpoint)
        engine = LLMEngine(ckpt, EngineConfig(role=role, num_blocks=8))
        assert "lm_head.weight" in ckpt.loaded_names
        assert not any(n.startswith("visual.") for n in ckpt.loaded_names)
        assert not any("visual" in n for n in engine.model.state_dict())


def test_encoder_batches_items_without_splitting(tiny_checkpoint, encoder):
    images = [make_image(200, 150, 1), make_image(90, 300, 2), make_image(60, 60, 3)]
    together = encoder.encode(images)
    small_budget = EncoderStage(open_checkpoint(tiny_checkpoint), max_batch_patches=1)  # one item per forward
    for a, b in zip(together, small_budget.encode(images)):
        assert a.key == b.key and a.grid_thw == b.grid_thw
        torch.testing.assert_close(a.embeddings, b.embeddings, rtol=1e-5, atol=1e-5)
    for item, image in zip(together, images):
        assert item.embeddings.shape == (encoder.processor.num_placeholder_tokens(image.height, image.width), 128)


def test_rows_not_matching_placeholders_fail_the_request_only(tiny_checkpoint, encoder, prompts, store):
    small, large = make_image(64, 64, 5), make_image(200, 200, 6)
    prompt = image_prompt(prompts, small)
    wrong = encoder.encode([large])[0].embeddings  # a key reused for another image size
    store.put(prompt.features[0].key, wrong)
    stage = PrefillStage(tiny_checkpoint, EngineConfig(num_blocks=64), store)
    stage.submit("bad", prompt.token_ids, GREEDY, prompt.features)
    stage.submit("good", [1, 2, 3, 4], GREEDY)
    results = {r.request_id: r for r in run_until_first_tokens(stage, 2)}
    assert results["bad"].finish_reason is FinishReason.ERROR and results["bad"].handoff is None
    assert (
        f"{wrong.shape[0]} rows" in results["bad"].error
        and f"reserves {prompt.features[0].length}" in results["bad"].error
    )
    assert results["good"].error is None and results["good"].handoff is not None
    stage.confirm("good")
    assert stage.engine.blocks.num_free == 64


def run_until_first_tokens(stage, n, timeout_s=30):
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out.extend(stage.step())
    return out


def test_prompt_waits_for_embeddings_without_blocking_others(tiny_checkpoint, encoder, prompts, store):
    image = make_image(120, 80, 7)
    prompt = image_prompt(prompts, image)
    stage = PrefillStage(tiny_checkpoint, EngineConfig(num_blocks=64, feature_timeout_s=30), store)
    stage.submit("image", prompt.token_ids, GREEDY, prompt.features)
    stage.submit("text", [5, 6, 7], GREEDY)
    first = stage.step()
    assert [r.request_id for r in first] == ["text"]  # the image prompt does not hold up the text one
    assert stage.step() == []  # still waiting, nothing to run
    item = encoder.encode([image])[0]
    store.put(item.key, item.embeddings)
    [late] = stage.step()
    assert late.request_id == "image" and late.error is None and late.handoff is not None


def test_missing_embeddings_time_out_with_a_clear_error(tiny_checkpoint, prompts, store):
    prompt = image_prompt(prompts, make_image(100, 100, 8))
    stage = PrefillStage(tiny_checkpoint, EngineConfig(num_blocks=64, feature_timeout_s=0.2), store)
    stage.submit("late", prompt.token_ids, GREEDY, prompt.features)
    results = run_until_first_tokens(stage, 1, timeout_s=5)
    assert len(results) == 1 and results[0].finish_reason is FinishReason.ERROR
    assert prompt.features[0].key in results[0].error and "0.2 s" in results[0].error
    assert not stage.has_unfinished() and stage.engine.blocks.num_free == 64


@pytest.mark.parametrize(
    "features, message",
    [
        ([], "placeholder tokens but its features cover 0"),
        ([FeatureSpec("k", 0, 4, (1, 4, 4))], "not all of them are placeholder"),
    ],
)
def test_inconsistent_feature_specs_are_rejected(tiny_checkpoint, prompts, store, features, message):
    prompt = image_prompt(prompts, make_image(56, 56, 9))
    stage = PrefillStage(tiny_checkpoint, EngineConfig(num_blocks=64), store)
    with pytest.raises(RequestError, match=message):
        stage.submit("x", prompt.token_ids, GREEDY, features)


def test_request_too_long_for_the_context_is_rejected(tiny_checkpoint, store):
    stage = PrefillStage(tiny_checkpoint, EngineConfig(num_blocks=64, max_model_len=32), store)
    with pytest.raises(RequestError, match="exceeds the context length 32"):
        stage.submit("x", list(range(30)), GREEDY)


def test_handoff_imports_under_other_block_ids_and_sizes(tiny_checkpoint, store):
    prefill = PrefillStage(tiny_checkpoint, EngineConfig(block_size=16, num_blocks=16), store)
    decode = DecodeStage(tiny_checkpoint, EngineConfig(block_size=4, num_blocks=64))
    decode.engine.blocks.free.rotate(7)  # different block ids on the receiving side
    prefill.submit("r", list(range(1, 40)), GREEDY)
    [result] = prefill.step()
    wire = result.handoff.to_bytes()
    decode.accept(KVHandoff.from_bytes(wire))
    prefill.confirm("r")
    tokens = [result.first_token] + [t for o in run(decode) for t in o.new_token_ids]
    both = LLMEngine(tiny_checkpoint, EngineConfig(num_blocks=16))
    both.add_request("r", list(range(1, 40)), GREEDY)
    assert tokens == [t for o in run(both) for t in o.new_token_ids]
    assert prefill.engine.blocks.num_free == 16 and decode.engine.blocks.num_free == 64


def test_damaged_or_foreign_handoffs_are_refused(tiny_checkpoint, store):
    prefill = PrefillStage(tiny_checkpoint, EngineConfig(num_blocks=16), store)
    decode = DecodeStage(tiny_checkpoint, EngineConfig(num_blocks=16))
    prefill.submit("r", [1, 2, 3, 4, 5], GREEDY)
    [result] = prefill.step()
    wire = result.handoff.to_bytes()
    with pytest.raises(KVHandoffError, match="bytes"):
        KVHandoff.from_bytes(wire[:-10])
    with pytest.raises(KVHandoffError, match="magic"):
        KVHandoff.from_bytes(b"garbage" + wire)
    foreign = KVHandoff(
        result.handoff.state.__class__(**{**result.handoff.state.__dict__, "model": "other"}), result.handoff.kv
    )
    with pytest.raises(KVHandoffError, match="different language model"):
        decode.accept(foreign)
    assert not decode.has_unfinished() and decode.engine.blocks.num_free == 16


def test_checkpoint_without_index_and_clear_errors(tiny_checkpoint, tmp_path):
    single = tmp_path / "single"
    shutil.copytree(tiny_checkpoint, single)
    tensors = {}
    for shard in sorted(single.glob("model-*.safetensors")):
        tensors.update(load_file(shard))
        shard.unlink()
    (single / "model.safetensors.index.json").unlink()
    save_file(tensors, single / "model.safetensors", metadata={"format": "pt"})
    a = LLMEngine(tiny_checkpoint, EngineConfig(num_blocks=8)).model.state_dict()
    b = LLMEngine(single, EngineConfig(num_blocks=8)).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    with pytest.raises(CheckpointError, match="config.json is missing"):
        open_checkpoint(tmp_path)
    config = json.loads((single / "config.json").read_text())
    (single / "config.json").write_text(json.dumps({**config, "model_type": "mystery"}))
    with pytest.raises(CheckpointError, match="'mystery'.*not supported"):
        LLMEngine(single, EngineConfig(num_blocks=8))


def test_handoff_size_is_known_before_the_copy(tiny_checkpoint, store):
    prefill = PrefillStage(tiny_checkpoint, EngineConfig(num_blocks=16), store)
    prefill.submit("r", list(range(1, 30)), GREEDY)
    [result] = prefill.step()
    assert prefill.engine.handoff_nbytes("r") == len(result.handoff.to_bytes())
