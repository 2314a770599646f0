"""Merge several Prometheus text expositions into one, so one scrape target serves a
whole local cluster (the gateway exposes its peers' metrics beside its own).

Families with the same name are merged into one block (Prometheus rejects a
second `# TYPE` line for a name); each source's samples get that source's extra
labels (e.g. `instance="127.0.0.1:9101"`), which override labels of the same
name, so two processes never produce the same series. Scrape such a target with
`honor_labels: true` to keep those `instance` labels as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)


class _Families:
    """The `collect()` interface `generate_latest` needs, over fixed families."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> list[Metric]:
        return self._families


def merge_families(sources: Iterable[tuple[dict[str, str], str]]) -> list[Metric]:
    """`sources`: (extra labels, exposition text) pairs; returns the merged families.

    A family whose type disagrees with an earlier source's is dropped from the
    later source (and logged): emitting both would make the scrape fail.
    """
    merged: dict[str, Metric] = {}
    for extra, text in sources:
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation,
                                                      family.type, family.unit)
            elif target.type != family.type:
                logger.warning("metric %s is a %s here but a %s elsewhere; dropped from %s",
                               family.name, family.type, target.type, extra)
                continue
            for sample in family.samples:
                target.samples.append(sample._replace(labels={**sample.labels, **extra}))
    return list(merged.values())


def render(sources: Iterable[tuple[dict[str, str], str]]) -> bytes:
    """The merged exposition, in the Prometheus text format (0.0.4)."""
    return generate_latest(_Families(merge_families(sources)))
