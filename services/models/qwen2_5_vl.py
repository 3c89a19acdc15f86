"""Qwen2.5-VL: the vision tower (encoder stage) and the text decoder (language stages).

Tensor names follow the released checkpoints (`visual.*`, `model.*`, `lm_head.*`);
see checkpoint.canonical_name for the transformers-5 spelling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.attention import AttentionMetadata, paged_attention
from services.models.layers import RMSNorm, SwiGLU, apply_rotary, varlen_attention

MODEL_TYPES = ("qwen2_5_vl",)


def is_vision_weight(name: str) -> bool:
    return name.startswith("visual.")


def is_language_weight(name: str) -> bool:
    return name.startswith(("model.", "lm_head."))


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    out_hidden_size: int
    rope_theta: float

    @staticmethod
    def from_hf(config: dict) -> "VisionConfig":
        v = config["vision_config"]
        return VisionConfig(
            depth=v["depth"],
            hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"],
            num_heads=v["num_heads"],
            in_channels=v.get("in_channels", v.get("in_chans", 3)),
            patch_size=v["patch_size"],
            temporal_patch_size=v["temporal_patch_size"],
            spatial_merge_size=v["spatial_merge_size"],
            window_size=v["window_size"],
            fullatt_block_indexes=tuple(v["fullatt_block_indexes"]),
            out_hidden_size=v["out_hidden_size"],
            rope_theta=(v.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        )


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    tie_word_embeddings: bool
    max_position_embeddings: int
    image_token_id: int
    spatial_merge_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @staticmethod
    def from_hf(config: dict) -> "TextConfig":
        # Released checkpoints keep text fields at the top level; transformers 5 nests them.
        t = {**config, **(config.get("text_config") or {})}
        rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
        return TextConfig(
            vocab_size=t["vocab_size"],
            hidden_size=t["hidden_size"],
            intermediate_size=t["intermediate_size"],
            num_layers=t["num_hidden_layers"],
            num_heads=t["num_attention_heads"],
            num_kv_heads=t.get("num_key_value_heads") or t["num_attention_heads"],
            rms_norm_eps=t.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", t.get("rope_theta", 1000000.0)),
            mrope_section=tuple(rope["mrope_section"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings") or t.get("tie_word_embeddings")),
            max_position_embeddings=t.get("max_position_embeddings", 32768),
            image_token_id=config["image_token_id"],
            spatial_merge_size=config["vision_config"]["spatial_merge_size"],
        )


# ----------------------------------------------------------------------------- vision


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        return self.proj(varlen_attention(q, k, v, cu_seqlens).flatten(1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size)
        self.norm2 = RMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim), nn.GELU(), nn.Linear(self.merged_dim, cfg.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=False)
        self.kernel = (cfg.in_channels, *kernel)

    def forward(self, pixel_patches: torch.Tensor) -> torch.Tensor:
        x = pixel_patches.view(-1, *self.kernel).to(self.proj.weight.dtype)
        return self.proj(x).flatten(1)


class VisionTower(nn.Module):
    """pixel patches [patches, C*T*P*P] + grid_thw [items, 3] -> one embedding block per item."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        head_dim = cfg.hidden_size // cfg.num_heads
        half = head_dim // 2
        # Explicit CPU device: modules are built under torch.device("meta") before loading.
        exponent = torch.arange(0, half, 2, dtype=torch.float, device="cpu") / half
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta**exponent, persistent=False)

    @property
    def output_width(self) -> int:
        return self.cfg.out_hidden_size

    def forward(self, pixel_patches: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        plan = _window_plan(grid_thw, self.cfg)
        x = self.patch_embed(pixel_patches)
        unit = self.cfg.spatial_merge_size**2
        order = (plan.window_index[:, None] * unit + torch.arange(unit)).flatten().to(x.device)
        x = x[order]
        angles = (plan.rope_positions[order.cpu()].to(x.device)[..., None].float() * self.inv_freq).flatten(1)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        for i, block in enumerate(self.blocks):
            segments = plan.image_seqlens if i in self.cfg.fullatt_block_indexes else plan.window_seqlens
            x = block(x, cos, sin, segments)
        merged = self.merger(x)[torch.argsort(plan.window_index).to(x.device)]
        return list(merged.split(plan.rows_per_item))


@dataclass(frozen=True)
class _WindowPlan:
    window_index: torch.Tensor  # merged-token order that groups tokens by attention window
    window_seqlens: list[int]  # cumulative patch counts per window (in window order)
    image_seqlens: list[int]  # cumulative patch counts per item
    rope_positions: torch.Tensor  # [patches, 2] (row, col) of each patch, merge-block major
    rows_per_item: list[int]


def _window_plan(grid_thw: list[tuple[int, int, int]], cfg: VisionConfig) -> _WindowPlan:
    merge, unit = cfg.spatial_merge_size, cfg.spatial_merge_size**2
    win = cfg.window_size // merge // cfg.patch_size
    window_index, window_seqlens, image_seqlens, positions, rows = [], [0], [0], [], []
    offset = 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        pad_h, pad_w = (-gh) % win, (-gw) % win
        index = F.pad(torch.arange(t * gh * gw).view(t, gh, gw), (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (gh + pad_h) // win, (gw + pad_w) // win
        index = index.view(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, win * win)
        sizes = (index >= 0).sum(-1).flatten()
        window_index.append(index[index >= 0] + offset)
        for n in sizes.tolist():
            if n:
                window_seqlens.append(window_seqlens[-1] + n * unit)
        image_seqlens.extend(image_seqlens[-1] + h * w * (i + 1) for i in range(t))
        rows_hw = torch.arange(h).view(gh, merge, 1, 1).expand(gh, merge, gw, merge)
        cols_hw = torch.arange(w).view(1, 1, gw, merge).expand(gh, merge, gw, merge)
        block_major = torch.stack([rows_hw.permute(0, 2, 1, 3).flatten(), cols_hw.permute(0, 2, 1, 3).flatten()], -1)
        positions.append(block_major.repeat(t, 1))
        rows.append(t * gh * gw)
        offset += t * gh * gw
    return _WindowPlan(
        window_index=torch.cat(window_index),
        window_seqlens=window_seqlens,
        image_seqlens=image_seqlens,
        rope_positions=torch.cat(positions),
        rows_per_item=rows,
    )


# ----------------------------------------------------------------------------- text


class MRotary(nn.Module):
    """Multimodal RoPE: the rotary halves are split into (temporal, height, width) sections."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        exponent = torch.arange(0, d, 2, dtype=torch.float, device="cpu") / d
        axis = torch.cat([torch.full((n,), i % 3, device="cpu") for i, n in enumerate(cfg.mrope_section)])
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta**exponent, persistent=False)
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, tokens] -> cos, sin: [tokens, head_dim]."""
        freqs = positions[..., None].float() * self.inv_freq  # [3, tokens, d/2]
        freqs = freqs.gather(0, self.axis.view(1, 1, -1).expand(1, freqs.shape[1], -1))[0]
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


class TextAttention(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.scale = cfg.num_heads, cfg.num_kv_heads, d**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=True)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(n, self.num_heads, -1), cos, sin)
        k = apply_rotary(self.k_proj(x).view(n, self.num_kv_heads, -1), cos, sin)
        v = self.v_proj(x).view(n, self.num_kv_heads, -1)
        return self.o_proj(paged_attention(q, k, v, cache, meta, self.scale).flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.self_attn = TextAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextBackbone(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LanguageModel(nn.Module):
    """Token embeddings in, logits out; attention state lives in the paged KV cache."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = TextBackbone(cfg)
        self.rotary = MRotary(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """embeds [tokens, hidden], positions [3, tokens], kv_cache [layers, 2, blocks, block, kv_heads, d]."""
        cos, sin = self.rotary(positions, embeds.dtype)
        x = embeds
        for layer, cache in zip(self.model.layers, kv_cache):
            x = layer(x, cos, sin, cache, meta)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, head).float()


# ----------------------------------------------------------------------------- positions


def mrope_positions(
    prompt_len: int, images: list[tuple[int, tuple[int, int, int]]], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """3-D positions of a prompt and the delta that continues them during decode.

    images: (offset of the first placeholder token, grid_thw) in prompt order.
    Text advances all three axes by one per token; an image occupies a t×h×w grid
    starting at the current position and advances it by its largest side.
    Returns positions [3, prompt_len] and `delta` such that token i >= prompt_len
    sits at position i + delta on every axis.
    """
    pieces, cursor, pos = [], 0, 0
    for offset, (t, h, w) in images:
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        pieces.append(torch.arange(offset - cursor).expand(3, -1) + pos)
        pos += offset - cursor
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pieces.append(torch.stack([tt, hh, ww]).flatten(1) + pos)
        cursor = offset + t * gh * gw
        pos += max(gh, gw)
    pieces.append(torch.arange(prompt_len - cursor).expand(3, -1) + pos)
    pos += prompt_len - cursor
    return torch.cat(pieces, dim=1), pos - prompt_len
