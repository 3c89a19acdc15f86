"""The decode pool's Prometheus metrics."""

from prometheus_client import Counter, Gauge, Histogram

from services.engine.llm_engine import LLMEngine

REQUESTS = Counter("epd_decode_requests", "Decode RPCs received")
GENERATED_TOKENS = Counter("epd_decode_generated_tokens", "Tokens streamed by Decode RPCs")
RUNNING = Gauge("epd_decode_running_sequences", "Sequences in the decode batch")
KV_PULL_SECONDS = Histogram(
    "epd_decode_kv_pull_seconds",
    "Time to pull one request's KV from a prefill server",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
KV_PULL_BYTES = Counter("epd_decode_kv_pull_bytes", "KV bytes pulled from prefill servers")


def observe(engine: LLMEngine) -> None:
    """Engine-thread hook: refresh the gauge."""
    RUNNING.set(engine.num_running)
