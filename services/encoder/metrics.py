"""The encoder pool's Prometheus metrics."""

from prometheus_client import Counter, Histogram

REQUESTS = Counter("epd_encoder_requests", "Encode RPCs received")
ITEMS = Counter("epd_encoder_items", "Items encoded by the vision tower, or found in the EC store", ["result"])
BATCH_SECONDS = Histogram("epd_encoder_batch_seconds", "Vision-tower batch time (forward + publish)")
BATCH_ITEMS = Histogram("epd_encoder_batch_items", "Items per vision-tower batch", buckets=(1, 2, 3, 4, 8, 16, 32, 64))
