"""The tokenizer service's metrics: how long each operation takes, how many tokens.

`pagoda_tokenizer_latency_seconds{operation}`: Tokenize (chat template + encode),
Detokenize, and DecodeStream (one message of the streaming decoder, which carries
deltas of many requests); `pagoda_tokenizer_tokens_total{operation}`: tokens
encoded by Tokenize and tokens decoded by DecodeStream.

Media (the service is the cluster's processor): `pagoda_tokenizer_media_fetch_seconds`
(each http(s) image fetch, its redirects and body; a cache hit too),
`pagoda_tokenizer_media_fetch_failures_total{reason}` (reason: the `MediaError`'s code,
e.g. media_fetch_timeout, media_domain_not_allowed), and vLLM's multi-modal processor
cache counters `vllm:mm_cache_queries` / `vllm:mm_cache_hits` (--mm-processor-cache-gb).
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from pagoda.services.common.metrics_server import one_per_process

OPERATIONS = ("Tokenize", "Detokenize", "DecodeStream")
LATENCY_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5]


class TokenizerMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.latency = Histogram("pagoda_tokenizer_latency_seconds",
                                 "Seconds the tokenizer spent on one operation.", ["operation"],
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.tokens = Counter("pagoda_tokenizer_tokens", "Tokens encoded or decoded.",
                              ["operation"], registry=registry)
        # Each operation's children, looked up once: `labels()` costs a lock and a dict
        # lookup per call, a visible share of a short request's Tokenize.
        self.latency_of = {op: self.latency.labels(op) for op in OPERATIONS}
        self.tokens_of = {op: self.tokens.labels(op) for op in OPERATIONS}
        self.media_fetch = Histogram("pagoda_tokenizer_media_fetch_seconds",
                                     "Seconds one http(s) media fetch took (cache hits too).",
                                     buckets=[0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0,
                                              2.5, 5.0, 10.0], registry=registry)
        self.media_fetch_failures = Counter("pagoda_tokenizer_media_fetch_failures",
                                            "Media fetches refused or failed, by reason.",
                                            ["reason"], registry=registry)
        self.mm_cache_queries = Counter("vllm:mm_cache_queries",
                                        "Multi-modal processor cache lookups.",
                                        registry=registry)
        self.mm_cache_hits = Counter("vllm:mm_cache_hits",
                                     "Multi-modal processor cache lookups that hit.",
                                     registry=registry)

    def observe_media_fetch(self, seconds: float, outcome: str) -> None:
        """`pagoda.multimodal.media.FetchObserver`: outcome "ok", "cache_hit" or a code."""
        self.media_fetch.observe(seconds)
        if outcome not in ("ok", "cache_hit"):
            self.media_fetch_failures.labels(outcome).inc()

    def observe_processor_cache(self, hits: int, queries: int) -> None:
        self.mm_cache_hits.inc(hits)
        self.mm_cache_queries.inc(queries)

    @contextmanager
    def time(self, operation: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.latency_of[operation].observe(time.perf_counter() - start)


@one_per_process
def tokenizer_metrics() -> TokenizerMetrics:
    """The process's TokenizerMetrics, in the default registry (created on first use)."""
    return TokenizerMetrics()


def timed(operation: str):
    """Decorator: time a unary RPC method as `operation`."""
    def decorate(method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                tokenizer_metrics().latency_of[operation].observe(time.perf_counter() - start)
        return wrapper
    return decorate
