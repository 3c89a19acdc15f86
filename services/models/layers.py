"""Building blocks shared by the model families."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 and cast back before the weight, as the reference does.
        in_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(in_dtype)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """Bidirectional attention within each segment of a packed sequence.

    q, k, v: [tokens, heads, head_dim]; segment i is tokens cu_seqlens[i]:cu_seqlens[i+1].
    Segments are padded into one batch so a single SDPA call covers them all.
    """
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    max_len = max(lengths)
    seg_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos_ids = torch.cat([torch.arange(n) for n in lengths])
    seg_ids, pos_ids = seg_ids.to(q.device), pos_ids.to(q.device)

    def pad(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros(len(lengths), max_len, *t.shape[1:])
        out[seg_ids, pos_ids] = t
        return out.transpose(1, 2)  # [segments, heads, max_len, head_dim]

    valid = torch.arange(max_len, device=q.device)[None, :] < torch.tensor(lengths, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=valid[:, None, None, :])
    return out.transpose(1, 2)[seg_ids, pos_ids]
