"""Added latency of the local cluster over the in-process path, per request.

    python -m loadtest.latency [--requests 10] [--max-tokens 16]

Runs the same kinds of requests (text-only; one new image each time, so the encoder
runs) through `InProcessEPD` and through a local cluster (proxy + gRPC + EC store +
KV pull), one at a time, and prints the median wall time of each and the difference:
the cost of the proxy, the RPCs and the connectors.
"""

from __future__ import annotations

import argparse
import base64
import statistics
import tempfile
import time

import openai

from connectors.ec import FilesystemECStore
from services.cluster import ClusterConfig, LocalCluster, free_port
from services.disaggregated import InProcessEPD
from services.engine.config import EngineConfig
from services.engine.sequence import SamplingParams
from services.models.tiny_checkpoint import ensure_tiny_checkpoint
from tests.conftest import make_image, png_bytes


def messages(kind: str, seed: int) -> list[dict]:
    if kind == "text":
        return [{"role": "user", "content": f"Tell me about the number {seed}."}]
    url = "data:image/png;base64," + base64.b64encode(png_bytes(make_image(160, 120, seed))).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]
    return [{"role": "user", "content": parts}]


def time_in_process(epd: InProcessEPD, kind: str, seeds: range, max_tokens: int) -> list[float]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = []
    for seed in seeds:
        start = time.perf_counter()
        [done] = epd.generate([(messages(kind, seed), sampling)])
        assert done.error is None and len(done.token_ids) == max_tokens
        out.append(time.perf_counter() - start)
    return out


def time_cluster(client: openai.OpenAI, model: str, kind: str, seeds: range, max_tokens: int) -> list[float]:
    out = []
    for seed in seeds:
        start = time.perf_counter()
        reply = client.chat.completions.create(
            model=model, messages=messages(kind, seed), temperature=0.0, max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert reply.usage.completion_tokens == max_tokens
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    checkpoint = ensure_tiny_checkpoint()
    n, tokens = args.requests, args.max_tokens
    with tempfile.TemporaryDirectory() as tmp:
        epd = InProcessEPD(checkpoint, FilesystemECStore(tmp, max_bytes=1 << 30), EngineConfig())
        time_in_process(epd, "image", range(1000, 1002), tokens)  # warm-up
        local = {kind: time_in_process(epd, kind, range(n), tokens) for kind in ("text", "image")}
    config = ClusterConfig(checkpoint=checkpoint, http_port=free_port())
    with LocalCluster(config) as cluster:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
        time_cluster(client, cluster.model_name, "image", range(2000, 2002), tokens)  # warm-up
        remote = {kind: time_cluster(client, cluster.model_name, kind, range(n), tokens) for kind in ("text", "image")}
        stages = stage_means(cluster.metrics("proxy"))
    print(f"{n} sequential requests per kind, {tokens} generated tokens each, tiny checkpoint on CPU")
    print(f"{'kind':<8}{'in-process ms':>15}{'cluster ms':>12}{'added ms':>10}{'ratio':>8}")
    for kind in ("text", "image"):
        a, b = statistics.median(local[kind]) * 1e3, statistics.median(remote[kind]) * 1e3
        print(f"{kind:<8}{a:>15.1f}{b:>12.1f}{b - a:>10.1f}{b / a:>8.2f}")
    print("proxy stage means over all cluster requests (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))


def stage_means(metrics_text: str) -> dict[str, float]:
    """Mean seconds per stage from the proxy's epd_proxy_stage_seconds histogram, in ms."""
    sums, counts = {}, {}
    for line in metrics_text.splitlines():
        for suffix, into in (("_sum", sums), ("_count", counts)):
            prefix = f"epd_proxy_stage_seconds{suffix}{{stage=\""
            if line.startswith(prefix):
                stage = line[len(prefix) :].split('"', 1)[0]
                into[stage] = float(line.rsplit(" ", 1)[1])
    return {stage: 1e3 * sums[stage] / counts[stage] for stage in sums if counts.get(stage)}


if __name__ == "__main__":
    main()
