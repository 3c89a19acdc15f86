"""The proxy's Prometheus metrics, in a registry of their own (served on GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
STAGES = ("tokenize", "encode", "prefill", "decode")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("epd_proxy_requests_total", "Chat requests by outcome", ["status"], registry=r)
        self.images = Counter("epd_proxy_images_total", "Images in accepted requests", registry=r)
        self.ttft = Histogram(
            "epd_proxy_ttft_seconds", "Request arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "epd_proxy_tpot_seconds", "Mean time per output token after the first", buckets=_TPOT_BUCKETS, registry=r
        )
        self.ec_hits = Counter("epd_proxy_ec_hits_total", "Image keys already in the EC store", registry=r)
        self.ec_misses = Counter("epd_proxy_ec_misses_total", "Image keys not in the EC store", registry=r)
        self.stage = Histogram(
            "epd_proxy_stage_seconds", "Time spent per stage", ["stage"], buckets=_LATENCY_BUCKETS, registry=r
        )
        for status in ("ok", "invalid", "error"):
            self.requests.labels(status)
        for stage in STAGES:
            self.stage.labels(stage)

    def render(self) -> bytes:
        return generate_latest(self.registry)
