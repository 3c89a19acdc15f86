"""Next-token selection: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws token i from a generator seeded with (seed, i), so its
output does not depend on which engine, batch or device produced earlier tokens:
a prefill engine and a decode engine continue one stream of randomness.
"""

from __future__ import annotations

import torch

from services.engine.sequence import SamplingParams

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def step_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + (index + 1) * _MIX) & _MASK


def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> list[int]:
    """logits [seqs, vocab] float32; indices[i] = how many tokens request i has generated so far."""
    greedy = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return greedy.tolist()
    rows = torch.tensor(random_rows, device=logits.device)
    chosen = _sample_rows(logits[rows], [params[i] for i in random_rows], [indices[i] for i in random_rows])
    greedy[rows] = chosen
    return greedy.tolist()


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=device)
    top_k = torch.tensor([p.top_k or probs.shape[-1] for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    # Keep a token if it is within top-k and the mass before it is below top-p (the first always stays).
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep = (rank[None, :] < top_k[:, None]) & (mass_before < top_p[:, None])
    kept = sorted_probs * keep
    cdf = kept.cumsum(-1)
    u = torch.stack([_uniform(p.seed, i) for p, i in zip(params, indices)]).to(device) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None]).clamp(max=probs.shape[-1] - 1)
    return order.gather(1, pick).squeeze(1)


def _uniform(seed: int | None, index: int) -> torch.Tensor:
    if seed is None:
        return torch.rand(())
    generator = torch.Generator().manual_seed(step_seed(seed, index))
    return torch.rand((), generator=generator)
