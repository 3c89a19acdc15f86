"""The prefill pool's Prometheus metrics."""

from prometheus_client import Counter, Gauge, Histogram

from services.engine.llm_engine import LLMEngine

REQUESTS = Counter("epd_prefill_requests", "Prefill RPCs received")
PROMPT_TOKENS = Counter("epd_prefill_prompt_tokens", "Prompt tokens of accepted Prefill requests")
SECONDS = Histogram(
    "epd_prefill_seconds",
    "Prefill RPC latency (includes waiting for embeddings)",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
HELD_HANDOFFS = Gauge("epd_prefill_held_handoffs", "Prefilled requests whose KV waits to be pulled and released")
WAITING = Gauge("epd_prefill_waiting_requests", "Prompts queued for prefill (including those waiting for embeddings)")


def observe(engine: LLMEngine) -> None:
    """Engine-thread hook: refresh the gauges."""
    HELD_HANDOFFS.set(engine.num_held())
    WAITING.set(engine.num_waiting)
