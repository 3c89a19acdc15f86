"""Model families by `model_type`, and the loaders each stage uses.

A family is one module exposing MODEL_TYPES, VisionConfig / TextConfig with
`from_hf`, VisionTower, LanguageModel, is_vision_weight, is_language_weight and
mrope_positions. Adding Qwen3-VL or a LLaVA-style model means adding one module
and listing it in _FAMILIES.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from services.models import qwen2_5_vl
from services.models.checkpoint import Checkpoint, CheckpointError

_FAMILIES: tuple[ModuleType, ...] = (qwen2_5_vl,)


def family_of(ckpt: Checkpoint) -> ModuleType:
    for family in _FAMILIES:
        if ckpt.model_type in family.MODEL_TYPES:
            return family
    known = sorted(t for f in _FAMILIES for t in f.MODEL_TYPES)
    raise CheckpointError(f"model_type {ckpt.model_type!r} in {ckpt.root} is not supported; supported: {known}")


def load_vision_tower(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> nn.Module:
    family = family_of(ckpt)
    prefix = "visual."
    with torch.device("meta"):
        tower = family.VisionTower(family.VisionConfig.from_hf(ckpt.config))
    weights = ckpt.load(family.is_vision_weight, dtype=dtype, device=device)
    _assign(tower, {k[len(prefix) :]: v for k, v in weights.items()}, ckpt)
    return tower.to(device).eval()


def load_language_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> nn.Module:
    family = family_of(ckpt)
    with torch.device("meta"):
        model = family.LanguageModel(family.TextConfig.from_hf(ckpt.config))
    weights = ckpt.load(family.is_language_weight, dtype=dtype, device=device)
    if model.cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    _assign(model, weights, ckpt)
    return model.to(device).eval()


def _assign(module: nn.Module, weights: dict[str, torch.Tensor], ckpt: Checkpoint) -> None:
    expected = set(module.state_dict())
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise CheckpointError(
            f"{ckpt.root}: weights do not match {type(module).__name__}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    module.load_state_dict(weights, assign=True, strict=True)
    # Non-persistent buffers (rotary tables) were created on meta; rebuild them for real.
    for name, buf in list(module.named_buffers()):
        if buf.is_meta:
            raise CheckpointError(f"buffer {name} was not initialized")
