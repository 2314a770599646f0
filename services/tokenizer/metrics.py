"""The tokenizer service's metrics: how long each operation takes, how many tokens.

`pagoda_tokenizer_latency_seconds{operation}`: Tokenize (chat template + encode),
Detokenize, and DecodeStream (one message of the streaming decoder, which carries
deltas of many requests); `pagoda_tokenizer_tokens_total{operation}`: tokens
encoded by Tokenize and tokens decoded by DecodeStream.
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
        for op in OPERATIONS:
            self.latency.labels(op)
            self.tokens.labels(op)

    @contextmanager
    def time(self, operation: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.latency.labels(operation).observe(time.perf_counter() - start)


@one_per_process
def tokenizer_metrics() -> TokenizerMetrics:
    """The process's TokenizerMetrics, in the default registry (created on first use)."""
    return TokenizerMetrics()


def timed(operation: str):
    """Decorator: time a unary RPC method as `operation`."""
    def decorate(method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            with tokenizer_metrics().time(operation):
                return method(*args, **kwargs)
        return wrapper
    return decorate
