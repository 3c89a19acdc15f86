"""Executes one batch on the language model: builds inputs, runs the forward, returns logits.

The runner sees block tables, never the allocator. Index tensors are built on the
CPU and moved to the device once per step.
"""

from __future__ import annotations

import torch

from services.engine.attention import AttentionMetadata
from services.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, device: torch.device) -> None:
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.device = device
        dtype = model.model.embed_tokens.weight.dtype
        # [layers, K/V, blocks, slots per block, kv heads, head dim]
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], features: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        """Runs each sequence's uncached prompt tokens; returns logits of each last token [seqs, vocab]."""
        ids, positions, fused_index, fused_rows = [], [], [], []
        start = 0
        for seq in seqs:
            begin = seq.num_cached
            ids.extend(seq.prompt_ids[begin:])
            positions.append(seq.prompt_positions[:, begin:])
            for spec, rows in zip(seq.features, features.get(seq.request_id, [])):
                assert spec.offset >= begin, "a prompt prefix with images is never cached here"
                fused_index.append(torch.arange(spec.length) + start + spec.offset - begin)
                fused_rows.append(rows)
            start += len(seq.prompt_ids) - begin
        embeds = self.model.embed(self._to_device(torch.tensor(ids)))
        if fused_index:
            rows = torch.cat(fused_rows).to(self.device, embeds.dtype, non_blocking=True)
            embeds.index_copy_(0, self._to_device(torch.cat(fused_index)), rows)
        query_lens = [len(s.prompt_ids) - s.num_cached for s in seqs]
        meta = self._metadata(seqs, query_lens, [len(s.prompt_ids) for s in seqs])
        hidden = self.model(embeds, self._to_device(torch.cat(positions, dim=1)), self.kv_cache, meta)
        last = torch.tensor(query_lens).cumsum(0) - 1
        return self.model.logits(hidden[self._to_device(last)])

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Runs the last token of each sequence; returns logits [seqs, vocab]."""
        ids = torch.tensor([s.last_token for s in seqs])
        pos = torch.tensor([s.num_tokens - 1 + s.mrope_delta for s in seqs])
        embeds = self.model.embed(self._to_device(ids))
        meta = self._metadata(seqs, [1] * len(seqs), [s.num_tokens for s in seqs])
        hidden = self.model(embeds, self._to_device(pos.expand(3, -1)), self.kv_cache, meta)
        return self.model.logits(hidden)

    def _metadata(self, seqs: list[Sequence], query_lens: list[int], context_lens: list[int]) -> AttentionMetadata:
        tables = [s.block_table for s in seqs]
        return AttentionMetadata.build(query_lens, context_lens, tables, self.block_size, self.device)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def read_kv(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """K/V of the first `num_tokens` tokens, token-major: [layers, 2, tokens, kv_heads, head_dim] on CPU."""
        return self._flat_cache()[:, :, self._slots(block_table, num_tokens)].cpu()

    def write_kv(self, block_table: list[int], kv: torch.Tensor) -> None:
        slots = self._slots(block_table, kv.shape[2])
        self._flat_cache()[:, :, slots] = kv.to(self.device, self.kv_cache.dtype)

    def _flat_cache(self) -> torch.Tensor:
        layers, two, blocks, size, heads, dim = self.kv_cache.shape
        return self.kv_cache.view(layers, two, blocks * size, heads, dim)

    def _slots(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        pos = torch.arange(num_tokens)
        table = torch.tensor(block_table, dtype=torch.long)
        return self._to_device(table[pos // self.block_size] * self.block_size + pos % self.block_size)
