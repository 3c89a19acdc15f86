"""A language-model engine configured from a service's flags."""

from __future__ import annotations

from connectors.ec import ECConsumer
from services.common.settings import EngineFlags, ModelFlags
from services.engine.config import EngineConfig, Role
from services.engine.llm_engine import LLMEngine

_OPTIONAL = ("max_num_batched_tokens", "feature_timeout_s")  # prefill-side flags only


def load_engine(settings: EngineFlags | ModelFlags, role: Role, ec: ECConsumer | None = None) -> LLMEngine:
    extra = {name: getattr(settings, name) for name in _OPTIONAL if hasattr(settings, name)}
    config = EngineConfig(
        role=role,
        device=settings.device,
        dtype=settings.dtype,
        block_size=settings.block_size,
        num_blocks=settings.num_blocks,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        **extra,
    )
    return LLMEngine(settings.checkpoint, config, ec)
