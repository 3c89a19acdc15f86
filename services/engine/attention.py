"""Causal attention over a paged KV cache (torch reference path).

One step may mix sequences at different positions: each has `query_len` new
tokens appended after `context_len - query_len` cached ones. New K/V are written
to their slots first, then every sequence attends to its whole context through
its block table. All index tensors are built once per step on the CPU and reused
by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] flat cache slot of each new token
    gather_slots: torch.Tensor  # [seqs, max_context] flat slots of each context
    mask: torch.Tensor  # [seqs, 1, max_query, max_context] True = may attend
    token_seq: torch.Tensor  # [tokens] which sequence a new token belongs to
    token_row: torch.Tensor  # [tokens] its row among that sequence's queries
    max_query_len: int

    @staticmethod
    def build(
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> "AttentionMetadata":
        num_seqs = len(query_lens)
        max_q, max_ctx = max(query_lens), max(context_lens)
        q_lens = torch.tensor(query_lens)
        ctx_lens = torch.tensor(context_lens)
        token_seq = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
        token_row = torch.cat([torch.arange(n) for n in query_lens])

        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
        ctx_pos = torch.arange(max_ctx)
        # Padding positions point at block 0; the mask keeps them out of the softmax.
        block_of = tables.gather(1, (ctx_pos // block_size).clamp(max=width - 1).expand(num_seqs, -1))
        gather_slots = block_of * block_size + ctx_pos % block_size

        new_pos = (ctx_lens - q_lens)[token_seq] + token_row
        slot_mapping = gather_slots[token_seq, new_pos]

        # Query row i of a sequence sits at position ctx - q + i and sees keys <= that.
        last_visible = (ctx_lens - q_lens)[:, None] + torch.arange(max_q)[None, :]
        mask = ctx_pos[None, None, :] <= last_visible[:, :, None]
        mask &= ctx_pos[None, None, :] < ctx_lens[:, None, None]
        return AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            gather_slots=gather_slots.to(device),
            mask=mask[:, None].to(device),
            token_seq=token_seq.to(device),
            token_row=token_row.to(device),
            max_query_len=max_q,
        )


def store_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """cache: [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [tokens, kv_heads, head_dim]."""
    flat = cache.view(2, -1, *cache.shape[3:])
    flat[0].index_copy_(0, slots, k.to(cache.dtype))
    flat[1].index_copy_(0, slots, v.to(cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] -> [tokens, heads, head_dim]."""
    store_kv(cache, k, v, meta.slot_mapping)
    flat = cache.view(2, -1, *cache.shape[3:])
    keys = flat[0][meta.gather_slots].transpose(1, 2)  # [seqs, kv_heads, ctx, d]
    values = flat[1][meta.gather_slots].transpose(1, 2)
    num_seqs = meta.gather_slots.shape[0]
    queries = q.new_zeros(num_seqs, meta.max_query_len, *q.shape[1:])
    queries[meta.token_seq, meta.token_row] = q
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=meta.mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)[meta.token_seq, meta.token_row]
