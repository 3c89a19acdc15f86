"""Multimodal features of a prompt: checking specs against the prompt, fetching them from the EC store."""

from __future__ import annotations

import torch

from connectors.ec import ECConsumer, ECCorruptEntryError
from services.engine.sequence import FeatureSpec, RequestError


def check_placeholders(prompt_ids: list[int], specs: list[FeatureSpec], placeholder_id: int) -> None:
    """Every spec must cover a run of placeholder tokens, and every placeholder must be covered."""
    covered = 0
    previous_end = 0
    for spec in sorted(specs, key=lambda s: s.offset):
        end = spec.offset + spec.length
        if spec.length < 1 or spec.offset < previous_end or end > len(prompt_ids):
            raise RequestError(
                f"feature {spec.key!r} spans tokens [{spec.offset}, {end}) which overlaps another feature "
                f"or lies outside the {len(prompt_ids)}-token prompt"
            )
        if any(t != placeholder_id for t in prompt_ids[spec.offset : end]):
            raise RequestError(
                f"feature {spec.key!r} spans tokens [{spec.offset}, {end}) but not all of them are "
                f"placeholder token {placeholder_id}"
            )
        covered += spec.length
        previous_end = end
    total = sum(1 for t in prompt_ids if t == placeholder_id)
    if total != covered:
        raise RequestError(f"the prompt has {total} placeholder tokens but its features cover {covered}")


def missing_keys(store: ECConsumer, specs: list[FeatureSpec]) -> list[str]:
    return [s.key for s in specs if not store.exists(s.key)]


def fetch_features(store: ECConsumer, specs: list[FeatureSpec], width: int) -> list[torch.Tensor]:
    """Embeddings per spec, checked against the placeholder count and the model width."""
    out = []
    for spec in specs:
        try:
            entry = store.get(spec.key)
        except ECCorruptEntryError as exc:
            raise RequestError(f"embeddings for {spec.key!r} are corrupted in the EC store: {exc}") from exc
        if entry is None:
            raise RequestError(f"embeddings for {spec.key!r} disappeared from the EC store (evicted?)")
        rows, cols = entry.tensor.shape
        if rows != spec.length:
            raise RequestError(
                f"embeddings for {spec.key!r} have {rows} rows but the prompt reserves {spec.length} "
                f"placeholder tokens at offset {spec.offset}; the key does not match this image size"
            )
        if cols != width:
            raise RequestError(f"embeddings for {spec.key!r} are {cols} wide but the model expects {width}")
        out.append(entry.tensor)
    return out
