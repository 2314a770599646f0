"""vLLM's in-memory metric objects (`vllm.v1.metrics.reader`), read from a registry.

`LLM.get_metrics()` returns these: every `vllm:` metric the engine recorded, as
`Counter` (name without prometheus_client's `_total` suffix, as vLLM reports it),
`Gauge`, `Histogram` (cumulative bucket counts keyed by upper bound, '+Inf'
included) and `Vector` (vLLM's type for the per-position spec-decode counter).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters (one per speculative position)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: `buckets[le]` counts those <= le ('+Inf': all, ==
    `count`); `sum` is the total of the observed values."""

    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        if family.type == "gauge":
            collected += [Gauge(family.name, s.labels, s.value) for s in _samples(family, "")]
        elif family.type == "counter":
            samples = _samples(family, "_total")
            if family.name == PER_POSITION:
                collected += _vectors(family.name, samples)
            else:
                collected += [Counter(family.name, s.labels, int(s.value)) for s in samples]
        elif family.type == "histogram":
            collected += _histograms(family)
    return collected


def _samples(family, suffix: str) -> list:
    return [s for s in family.samples if s.name == family.name + suffix]


def _key(labels: dict[str, str], drop: str | None = None) -> frozenset:
    return frozenset((k, v) for k, v in labels.items() if k != drop)


def _histograms(family) -> list[Histogram]:
    buckets: dict[frozenset, dict[str, int]] = {}
    for s in _samples(family, "_bucket"):
        buckets.setdefault(_key(s.labels, "le"), {})[s.labels["le"]] = int(s.value)
    counts = {_key(s.labels): int(s.value) for s in _samples(family, "_count")}
    sums = {_key(s.labels): s.value for s in _samples(family, "_sum")}
    return [Histogram(family.name, dict(key), counts[key], sums[key], by_le)
            for key, by_le in buckets.items()]


def _vectors(name: str, samples: list) -> list[Vector]:
    by_labels: dict[frozenset, dict[int, int]] = {}
    for s in samples:
        by_labels.setdefault(_key(s.labels, "position"), {})[int(s.labels["position"])] = int(s.value)
    vectors = []
    for key, by_position in by_labels.items():
        values = [0] * (max(by_position) + 1)
        for position, value in by_position.items():
            values[position] = value
        vectors.append(Vector(name, dict(key), values))
    return vectors
