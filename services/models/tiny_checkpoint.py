"""Deterministic tiny Qwen2.5-VL checkpoint (random weights, locally trained tokenizer).

`python -m services.models.tiny_checkpoint OUT_DIR [--seed 0]` writes a Hugging Face
directory that `Qwen2_5_VLForConditionalGeneration.from_pretrained` and
`AutoTokenizer.from_pretrained` load offline. Same seed -> byte-identical files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

ENV_VAR = "EPD_TINY_CHECKPOINT"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO_ROOT / ".cache" / "tiny-qwen2_5_vl"

# Qwen's order; ids are consecutive right after the BPE vocab.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Same split regex as transformers' Qwen2Tokenizer, which rebuilds its pipeline with it on load.
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
STAMP_NAME = "epd_tiny_checkpoint.json"  # which generator source + seed wrote the dir
SHARD_NAMES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX_NAME = "model.safetensors.index.json"
CHECKPOINT_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.json",
    INDEX_NAME,
    *SHARD_NAMES,
    STAMP_NAME,
)
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Qwen2.5-VL's template, widened to any part whose type mentions "image" / "video".
# HF renders with trim_blocks, so no literal newline may directly follow a block tag.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% set ctype = content['type'] if content['type'] is defined else '' %}"
    "{% if 'image' in ctype or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'video' in ctype or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    bpe_vocab_size: int = 1500
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    mrope_section: tuple[int, int, int] = (4, 6, 6)
    max_position_embeddings: int = 4096
    vision_depth: int = 4
    vision_hidden_size: int = 64
    vision_intermediate_size: int = 128
    vision_num_heads: int = 4
    fullatt_block_indexes: tuple[int, ...] = (1, 3)
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 128
    # Measured: larger hidden stds make the net chaotic (fp32-vs-fp64 logit error grows
    # ~1e-5 at 0.1 -> 3e-3 at 0.3), smaller ones make greedy output loop on a few tokens.
    # A wide lm_head spreads the logits (std ~11) so top-1/top-2 gaps sit far above that error.
    weight_std: float = 0.11
    lm_head_std: float = 1.0
    bias_std: float = 0.02
    norm_noise_std: float = 0.05


SPEC = TinySpec()


# --- tokenizer -----------------------------------------------------------------------------

_PARAGRAPHS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the porch.
A small robot named Pixel learned to paint pictures of mountains, rivers and old cities.
Every morning the baker opens the shop at six o'clock and sells warm bread to neighbours.
Scientists measured the temperature of the ocean at 42 stations during the summer of 2019.
She asked, "Where did you put the keys?" and he answered: "On the kitchen table, next to the lamp."
Trains leave the central station every fifteen minutes; the last one departs at 11:45 pm.
The image shows a red bicycle leaning against a white fence under a bright blue sky.
In the picture there are three cats, two dogs, and a parrot sitting on a wooden chair.
Describe the scene: a crowded market with fruit stalls, colourful umbrellas and many people.
What is the capital of France? Paris is the capital and the largest city of France.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5
for (int i = 0; i < 10; ++i) { total += values[i]; }
{"name": "tiny", "layers": 4, "hidden": 128, "ok": true, "ratio": 0.75}
Weather report: cloudy with a chance of rain in the afternoon, winds from the north-west.
The museum opened a new exhibition about ancient Egypt, Greece, Rome and China.
I'm sure they'll arrive soon; we've waited long enough, haven't we? It's nearly dinner time.
Mathematics: 3.14159 is close to pi, e is about 2.71828, and the square root of 2 is 1.41421.
Cafe menu: espresso 2.50, latte 3.80, croissant 1.90, soup of the day 4.20, water free.
Directions: turn left at the bridge, go straight for 200 metres, then take the second right.
Naïve façade, résumé, jalapeño, Zürich, São Paulo, Kraków, Ærø; 世界 你好, こんにちは, 🙂 🚀.
"""

_SUBJECTS = (
    "the teacher",
    "a student",
    "my neighbour",
    "the old man",
    "a young girl",
    "the engineer",
    "our team",
    "the doctor",
    "a tourist",
    "the pilot",
    "the children",
    "the artist",
    "a farmer",
    "the camera",
    "the model",
    "this photo",
    "the driver",
    "a musician",
    "the river",
    "the city",
    "the committee",
    "a scientist",
    "the gardener",
    "my grandmother",
    "the captain",
    "a lawyer",
)
_VERBS = """
reads writes builds paints finds carries describes watches opens closes counts measures cleans
repairs draws shows explains follows remembers answers collects visits compares arranges
photographs borrows delivers discovers examines gathers imagines introduces invents juggles
launches lifts manages mentions notices orders organizes paddles plants polishes prepares
presents protects pulls pushes questions receives records recommends reflects replaces
rescues reviews scratches searches selects shares sketches sorts studies supports teaches
throws touches translates travels trusts understands unlocks washes weighs whispers wraps
""".split()
_ADJECTIVES = """
green large tiny ancient modern quiet noisy bright dark heavy light round square broken shiny
wooden metal plastic golden purple yellow orange striped spotted narrow wide famous strange
simple careful clever curious delicate elegant empty enormous fragile friendly gentle gigantic
graceful hollow humble hungry jolly lively lonely lucky magnificent mysterious nervous obvious
ordinary peaceful polite powerful precious proud rapid rare rough rusty sandy silent slippery
smooth sparkling spicy steep sticky stormy sturdy sudden sweet tender thirsty transparent
useful valuable vivid warm wealthy wild windy wise wonderful wrinkled frozen crimson silver
""".split()
_NOUNS = """
book letter bridge boat window garden house machine picture map clock flower mountain table
chair bottle computer phone camera road forest island castle tower engine guitar kitchen ladder
basket blanket bucket candle feather hammer helmet jacket lantern mirror pencil pillow rocket
saddle shovel tunnel umbrella violin wagon whistle zebra elephant giraffe penguin dolphin turtle
rabbit airplane anchor apron backpack balloon bandage barrel battery beacon bench bicycle
biscuit blossom bracelet branch breeze brick broom button cabbage cabin canal canyon carpet
carrot cathedral cellar chimney circus cliff cloud compass cottage crayon crystal cushion
desert diamond dictionary dinosaur envelope factory fountain galaxy glacier harbour hedgehog
highway horizon iceberg jungle kettle keyboard lighthouse meadow microscope monument necklace
notebook ocean orchard oyster palace parachute passport pebble piano planet puzzle pyramid
quilt railway rainbow recipe saucepan scarf sculpture shelter skeleton snowflake spider
squirrel stadium statue submarine suitcase sunflower telescope tent theatre thunder tractor
trumpet valley vase village volcano waterfall whale windmill wizard workshop
""".split()
_PLACES = (
    "near the station",
    "in the park",
    "at the harbour",
    "behind the school",
    "on the roof",
    "under the bridge",
    "inside the museum",
    "next to the library",
    "across the street",
    "along the coast",
    "in the valley",
    "by the lake",
    "at the airport",
    "in the laboratory",
    "beside the fireplace",
    "through the window",
    "beyond the hills",
    "around the corner",
)
_TIMES = (
    "yesterday",
    "today",
    "every Monday",
    "in the evening",
    "at noon",
    "last winter",
    "on Sunday",
    "before breakfast",
    "after lunch",
    "during the storm",
    "in 1998",
    "at 7:30",
    "twice a week",
    "quietly",
    "carefully",
    "suddenly",
    "eventually",
    "immediately",
    "occasionally",
    "gradually",
)


def _generated_sentences(count: int) -> Iterator[str]:
    rng = random.Random(1234)  # Random(int).choice/randrange are stable across Python versions.
    for i in range(count):
        words = (
            rng.choice(_SUBJECTS),
            rng.choice(_VERBS),
            "a" if i % 3 else "the",
            rng.choice(_ADJECTIVES),
            rng.choice(_NOUNS),
            rng.choice(_PLACES),
            rng.choice(_TIMES),
        )
        sentence = " ".join(words)
        tail = ("." if i % 4 else "?") if i % 7 else f", number {rng.randrange(10000)}."
        yield sentence[0].upper() + sentence[1:] + tail


def training_corpus() -> list[str]:
    """Deterministic built-in English corpus (~80 KB, ~600 distinct words)."""
    return _PARAGRAPHS.splitlines() + list(_generated_sentences(1200))


def _qwen_style_tokenizer(model: BPE) -> Tokenizer:
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def build_tokenizer(spec: TinySpec = SPEC) -> Tokenizer:
    tok = _qwen_style_tokenizer(BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=spec.bpe_vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def token_ids(tok: Tokenizer) -> dict[str, int]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    first = tok.get_vocab_size(with_added_tokens=False)
    if list(ids.values()) != list(range(first, first + len(ids))):
        raise RuntimeError(f"special tokens must follow the BPE vocab consecutively, got {ids}")
    return ids


def padded_vocab_size(tok: Tokenizer) -> int:
    return -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64


# --- config files --------------------------------------------------------------------------


def model_config(spec: TinySpec, ids: dict[str, int], vocab_size: int) -> dict:
    """Flat layout as in the released Qwen2.5-VL config.json files."""
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": list(spec.mrope_section)},
        "sliding_window": spec.max_position_embeddings,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
        "vision_config": {
            "depth": spec.vision_depth,
            "hidden_act": "silu",
            "hidden_size": spec.vision_hidden_size,
            "intermediate_size": spec.vision_intermediate_size,
            "num_heads": spec.vision_num_heads,
            "in_chans": 3,
            "in_channels": 3,
            "out_hidden_size": spec.hidden_size,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": list(spec.fullatt_block_indexes),
            "tokens_per_second": 2,
        },
    }


def generation_config(ids: dict[str, int]) -> dict:
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": False,
    }


def preprocessor_config(spec: TinySpec) -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "merge_size": 2,
        "min_pixels": spec.min_pixels,
        "max_pixels": spec.max_pixels,
        "patch_size": 14,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        "temporal_patch_size": 2,
    }


def processor_config() -> dict:
    return {"processor_class": "Qwen2_5_VLProcessor"}


def tokenizer_config(ids: dict[str, int]) -> dict:
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in ids.items()
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# --- weights -------------------------------------------------------------------------------


def hf_to_original_name(name: str) -> str:
    """transformers-5 module path -> tensor name in the released Qwen2.5-VL checkpoints."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith("model.visual."):
        return name[len("model.") :]
    return name


def parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Original-name -> shape, taken from the HF model itself (built on the meta device)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(**config)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(cfg)
    return {hf_to_original_name(n): tuple(p.shape) for n, p in model.named_parameters()}


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _std_normal(shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    # Irwin-Hall(4) approximation of N(0, 1) from torch uniforms, using only + and *:
    # torch's CPU normal_ kernel takes an ISA-specific path (AVX2 vs scalar), so its bits
    # differ across machines; these stay byte-identical everywhere.
    total = torch.zeros(shape, dtype=torch.float64)
    for _ in range(4):
        total = total + torch.rand(shape, generator=gen, dtype=torch.float64)
    return (total - 2.0) * 3.0**0.5


def init_tensor(name: str, shape: Sequence[int], seed: int, spec: TinySpec = SPEC) -> torch.Tensor:
    noise = _std_normal(shape, _generator(seed, name))
    if name.endswith(".bias"):
        value = noise * spec.bias_std
    elif name == "lm_head.weight":
        value = noise * spec.lm_head_std
    elif len(shape) == 1:  # RMSNorm / LayerNorm gains
        value = 1.0 + noise * spec.norm_noise_std
    else:
        value = noise * spec.weight_std
    return value.to(torch.float32).contiguous()


# Tokens a trained model never emits: vision markers/pads, and vocab padding past the
# tokenizer (undecodable). Zero lm_head rows pin their logit at 0, far below the greedy
# winner, so the random model does not emit them (an emitted <|image_pad|> breaks prefill).
NEVER_GENERATED = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def silenced_token_ids(ids: dict[str, int], tokenizer_size: int, vocab_size: int) -> list[int]:
    return sorted([ids[t] for t in NEVER_GENERATED] + list(range(tokenizer_size, vocab_size)))


def random_weights(
    shapes: dict[str, tuple[int, ...]],
    seed: int,
    spec: TinySpec = SPEC,
    silenced_ids: Sequence[int] = (),
) -> dict[str, torch.Tensor]:
    weights = {name: init_tensor(name, shape, seed, spec) for name, shape in sorted(shapes.items())}
    weights["lm_head.weight"][list(silenced_ids)] = 0.0
    return weights


def split_shards(names: list[str], num_layers: int) -> tuple[list[str], list[str]]:
    """Shard 1: vision tower + first half of the LM layers; shard 2: the rest."""
    first, second = [], []
    for name in sorted(names):
        parts = name.split(".")
        in_first = (
            parts[0] == "visual"
            or (parts[:2] == ["model", "layers"] and int(parts[2]) < num_layers // 2)
            or parts[:2] == ["model", "embed_tokens"]
        )
        (first if in_first else second).append(name)
    return first, second


def write_weights(out: Path, weights: dict[str, torch.Tensor], num_layers: int) -> None:
    total = sum(t.numel() * t.element_size() for t in weights.values())
    weight_map: dict[str, str] = {}
    for shard_name, names in zip(SHARD_NAMES, split_shards(list(weights), num_layers)):
        save_file({n: weights[n] for n in names}, str(out / shard_name), metadata={"format": "pt"})
        weight_map.update({n: shard_name for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / INDEX_NAME, index)


# --- assembly ------------------------------------------------------------------------------


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tiny_checkpoint(out_dir: str | os.PathLike, seed: int = 0, *, spec: TinySpec = SPEC) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(spec)
    ids = token_ids(tok)
    config = model_config(spec, ids, padded_vocab_size(tok))
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(ids))
    _write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(ids))
    _write_json(out / "preprocessor_config.json", preprocessor_config(spec))
    _write_json(out / "processor_config.json", processor_config())
    silenced = silenced_token_ids(ids, tok.get_vocab_size(with_added_tokens=True), config["vocab_size"])
    weights = random_weights(parameter_shapes(config), seed, spec, silenced)
    write_weights(out, weights, spec.num_hidden_layers)
    _write_json(out / STAMP_NAME, stamp(seed, spec))
    for name in CHECKPOINT_FILES:
        os.chmod(out / name, 0o644)  # safetensors writes 0600
    return out


def stamp(seed: int, spec: TinySpec = SPEC) -> dict:
    source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    # JSON round trip so it compares equal to what is read back (tuples -> lists).
    return json.loads(json.dumps({"generator_sha256": source, "seed": seed, "spec": asdict(spec)}))


def is_complete(path: Path, seed: int = 0) -> bool:
    """All files present and written by this exact generator source (stale caches are redone)."""
    if not all((path / name).is_file() for name in CHECKPOINT_FILES):
        return False
    try:
        return json.loads((path / STAMP_NAME).read_text(encoding="utf-8")) == stamp(seed)
    except (OSError, ValueError):
        return False


def default_path() -> Path:
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else DEFAULT_DIR


def ensure_tiny_checkpoint(path: str | os.PathLike | None = None) -> Path:
    """Return a complete checkpoint at `path`, writing it if missing or incomplete.

    Writes into a sibling temp dir and renames it into place, so readers never see a
    partial directory; when two processes race, the loser discards its copy.
    """
    target = Path(path) if path is not None else default_path()
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)
        write_tiny_checkpoint(tmp)
        if target.exists() and not is_complete(target):
            _discard(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target):  # someone else holds a broken dir; surface that
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _discard(path: Path) -> None:
    """Move an incomplete directory aside first, so the rename into place is atomic."""
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.trash-", dir=path.parent))
    try:
        os.rename(path, trash / "old")
    except FileNotFoundError:
        pass  # another process already cleared it
    shutil.rmtree(trash, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = write_tiny_checkpoint(args.out_dir, seed=args.seed)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
