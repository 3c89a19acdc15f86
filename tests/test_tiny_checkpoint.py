"""The tiny Qwen2.5-VL checkpoint: deterministic bytes, loads in HF, usable tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from services.models import tiny_checkpoint as tc


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tc.write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="session")
def hf_model(tiny_dir: Path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir, output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="session")
def tokenizer(tiny_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def _file_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in tc.SHARD_NAMES:
        tensors.update(load_file(path / shard))
    return tensors


def _hf_name(original: str) -> str:
    if original.startswith("visual."):
        return "model." + original
    if original.startswith("model."):
        return "model.language_model." + original[len("model.") :]
    return original


def test_writing_twice_is_byte_identical(tiny_dir: Path, tmp_path: Path) -> None:
    again = tc.main([str(tmp_path / "again")])
    assert again == 0
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == sorted(tc.CHECKPOINT_FILES)
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == names
    for name in names:
        assert (tiny_dir / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def test_other_seed_changes_only_weights(tiny_dir: Path, tmp_path: Path) -> None:
    other = tc.write_tiny_checkpoint(tmp_path / "seed1", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    assert (other / tc.SHARD_NAMES[0]).read_bytes() != (tiny_dir / tc.SHARD_NAMES[0]).read_bytes()


def test_shards_use_original_qwen_names(tiny_dir: Path) -> None:
    index = json.loads((tiny_dir / tc.INDEX_NAME).read_text())
    weight_map = index["weight_map"]
    assert list(weight_map) == sorted(weight_map)
    assert set(weight_map.values()) == set(tc.SHARD_NAMES)
    assert all(n.split(".")[0] in {"model", "visual", "lm_head"} for n in weight_map)
    assert not any("language_model" in n for n in weight_map)
    for name in (
        "model.embed_tokens.weight",
        "model.layers.3.self_attn.q_proj.bias",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.2.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
        "visual.patch_embed.proj.weight",
        "visual.blocks.3.attn.qkv.bias",
        "visual.blocks.0.mlp.down_proj.bias",
        "visual.merger.ln_q.weight",
        "visual.merger.mlp.2.bias",
    ):
        assert name in weight_map, name
    for shard in tc.SHARD_NAMES:
        with safe_open(tiny_dir / shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert all(f.get_slice(k).get_dtype() == "F32" for k in f.keys())
    total = sum(t.numel() * 4 for t in _file_tensors(tiny_dir).values())
    assert index["metadata"]["total_size"] == total


def test_config_sizes(hf_model) -> None:
    model, _ = hf_model
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (128, 352, 4)
    assert (text.num_attention_heads, text.num_key_value_heads) == (4, 2)
    assert text.rope_parameters["mrope_section"] == [4, 6, 6]
    assert text.rope_parameters["rope_theta"] == 1000000.0
    assert text.vocab_size % 64 == 0
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads) == (4, 64, 128, 4)
    assert list(vision.fullatt_block_indexes) == [1, 3]
    assert (vision.out_hidden_size, vision.window_size, vision.tokens_per_second) == (128, 112, 2)
    assert model.config.tie_word_embeddings is False
    assert model.dtype == torch.float32


def test_hf_loads_every_tensor(tiny_dir: Path, hf_model) -> None:
    model, info = hf_model
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    file_tensors = _file_tensors(tiny_dir)
    assert {_hf_name(n) for n in file_tensors} == {n for n, _ in model.named_parameters()}
    for name, tensor in file_tensors.items():
        assert torch.equal(state[_hf_name(name)], tensor), name


def test_special_token_ids_match_config(tokenizer, hf_model) -> None:
    model, _ = hf_model
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tc.SPECIAL_TOKENS]
    assert ids == list(range(ids[0], ids[0] + len(ids)))
    assert len(tokenizer) == ids[-1] + 1 <= model.config.text_config.vocab_size
    by_name = dict(zip(tc.SPECIAL_TOKENS, ids))
    cfg = model.config
    assert cfg.image_token_id == by_name["<|image_pad|>"]
    assert cfg.video_token_id == by_name["<|video_pad|>"]
    assert cfg.vision_start_token_id == by_name["<|vision_start|>"]
    assert cfg.vision_end_token_id == by_name["<|vision_end|>"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    gen = model.generation_config
    assert gen.eos_token_id == [by_name["<|im_end|>"], by_name["<|endoftext|>"]]
    assert gen.pad_token_id == by_name["<|endoftext|>"] and gen.do_sample is False


@pytest.mark.parametrize(
    "text",
    [
        "héllo 世界 🙂",
        "The quick brown fox.\n\n  indented\ttab  trailing  ",
        "def f(x):\n    return x ** 2  # comment",
        "Ünïcödé — “quotes” ½ ∑ 🚀🚀 a\u200db \r\n end",
        "<|im_start|>user\nhi<|im_end|>",
    ],
)
def test_tokenizer_round_trip(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_tokenizer_vocab_is_about_1500_plus_specials(tokenizer) -> None:
    assert len(tokenizer) == 1500 + len(tc.SPECIAL_TOKENS)
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == 1500


def test_chat_template_renders_qwen_layout(tokenizer, tiny_dir: Path) -> None:
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello"},
    ]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n"
    )
    shipped = json.loads((tiny_dir / "chat_template.json").read_text())["chat_template"]
    assert shipped == json.loads((tiny_dir / "tokenizer_config.json").read_text())["chat_template"]


def test_preprocessor_config(tiny_dir: Path) -> None:
    cfg = json.loads((tiny_dir / "preprocessor_config.json").read_text())
    assert cfg["image_processor_type"] == "Qwen2VLImageProcessor"
    assert (cfg["min_pixels"], cfg["max_pixels"]) == (3136, 100352)
    assert cfg["size"] == {"shortest_edge": 3136, "longest_edge": 100352}
    assert (cfg["patch_size"], cfg["merge_size"], cfg["temporal_patch_size"]) == (14, 2, 2)


def _generate(model, tokenizer, text: str, images: list[Image.Image]) -> list[int]:
    from services.multimodal.processor import ImageProcessor

    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    extra = {}
    if images:
        processed = ImageProcessor.from_pretrained(model.name_or_path).preprocess(images)
        head, *rest = prompt.split("<|image_pad|>")
        prompt = head + "".join("<|image_pad|>" * n + p for n, p in zip(processed.placeholder_counts, rest))
        extra = {"pixel_values": processed.pixel_values, "image_grid_thw": processed.grid_thw}
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, **extra, max_new_tokens=48, min_new_tokens=48, do_sample=False, eos_token_id=None
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _noise_image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)


def test_random_model_is_not_degenerate(hf_model, tokenizer) -> None:
    model, _ = hf_model
    text_out = _generate(model, tokenizer, "Describe the weather in Paris.", [])
    assert len(set(text_out)) >= 12
    a = _generate(model, tokenizer, "What is in this picture?", [_noise_image(1, (224, 224))])
    b = _generate(model, tokenizer, "What is in this picture?", [_noise_image(2, (224, 224))])
    assert a != b
    silenced = set(tc.NEVER_GENERATED)
    emitted = set(tokenizer.convert_ids_to_tokens(text_out + a + b))
    assert not emitted & silenced
    assert max(text_out + a + b) < len(tokenizer)


def test_ensure_creates_then_reuses(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "cache" / "tiny"
    monkeypatch.setenv(tc.ENV_VAR, str(target))
    assert tc.ensure_tiny_checkpoint() == target
    assert tc.is_complete(target)
    before = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}
    assert tc.ensure_tiny_checkpoint(target) == target
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == before
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny"]  # no temp dirs left


def test_ensure_replaces_incomplete_dir(tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "config.json").write_text("{}")
    tc.ensure_tiny_checkpoint(target)
    assert tc.is_complete(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_ensure_survives_losing_a_race(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "tiny"

    def write_while_another_process_wins(out_dir, seed=0):
        shutil.copytree(tiny_dir, out_dir, dirs_exist_ok=True)
        shutil.copytree(tiny_dir, target)  # the other process renames its copy into place first
        return Path(out_dir)

    monkeypatch.setattr(tc, "write_tiny_checkpoint", write_while_another_process_wins)
    assert tc.ensure_tiny_checkpoint(target) == target
    assert tc.is_complete(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]
