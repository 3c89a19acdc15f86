"""A Hugging Face–format checkpoint directory, read lazily.

Only the tensors a stage asks for are materialized: the encoder never reads a
language-model tensor and the language stages never read a vision tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import torch
from safetensors import safe_open

# transformers 5 nests the towers under `model.`; released checkpoints do not.
# Canonical names here are the released ones: `visual.*`, `model.*`, `lm_head.*`.
_RENAMES = (
    (re.compile(r"^model\.visual\."), "visual."),
    (re.compile(r"^model\.language_model\."), "model."),
)


def canonical_name(name: str) -> str:
    for pattern, replacement in _RENAMES:
        name, count = pattern.subn(replacement, name)
        if count:
            break
    return name


class CheckpointError(ValueError):
    """The checkpoint directory is missing something or is malformed."""


@dataclass
class Checkpoint:
    root: Path
    config: dict
    # canonical tensor name -> (file, name as stored in that file)
    index: dict[str, tuple[Path, str]]
    loaded_names: list[str] = field(default_factory=list)

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    def names(self) -> list[str]:
        return sorted(self.index)

    def load(
        self,
        wanted: Callable[[str], bool],
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> dict[str, torch.Tensor]:
        """Materialize only the tensors whose canonical name satisfies `wanted`."""
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for name, (path, stored) in self.index.items():
            if wanted(name):
                by_file.setdefault(path, []).append((name, stored))
        out: dict[str, torch.Tensor] = {}
        for path, entries in by_file.items():
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name, stored in entries:
                    tensor = f.get_tensor(stored)
                    if dtype is not None and tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    out[name] = tensor.to(device)
                    self.loaded_names.append(name)
        return out

    def read_json(self, filename: str) -> dict | None:
        path = self.root / filename
        return json.loads(path.read_text()) if path.exists() else None


def open_checkpoint(path: str | Path) -> Checkpoint:
    root = Path(path)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{root} is not a checkpoint directory: config.json is missing")
    config = json.loads(config_path.read_text())
    return Checkpoint(root=root, config=config, index=_tensor_index(root))


def _tensor_index(root: Path) -> dict[str, tuple[Path, str]]:
    index_path = root / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = {root / fname for fname in weight_map.values()}
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"shards named in {index_path.name} are missing: {missing}")
        return {canonical_name(n): (root / f, n) for n, f in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weight files in {root}")
    return dict(_names_in(files))


def _names_in(files: Iterable[Path]) -> Iterable[tuple[str, tuple[Path, str]]]:
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for stored in f.keys():
                yield canonical_name(stored), (path, stored)


def vision_identity(config: dict) -> str:
    """Identity of the vision tower for content keys, from config.json alone (the proxy holds
    no weights): model type plus a hash of the vision config."""
    vision = json.dumps(config.get("vision_config", {}), sort_keys=True, separators=(",", ":"))
    return f"{config.get('model_type', '')}:{blake3.blake3(vision.encode()).hexdigest()[:16]}"
