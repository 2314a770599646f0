"""The reaper drops instances whose heartbeat lapsed, after a grace period at start."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from pagoda.services.kv_cache_manager.index import PrefixIndex
from pagoda.services.kv_cache_manager.metrics import KvIndexMetrics
from pagoda.services.kv_cache_manager.reaper import Reaper


def test_a_silent_instance_is_dropped_and_the_gauges_follow(redis_client):
    index = PrefixIndex(redis_client, heartbeat_timeout=0.6)
    metrics = KvIndexMetrics(CollectorRegistry())
    index.heartbeat("m", 4, "quiet", "e1", 0)
    reaper = Reaper(index, metrics, interval=0.05).start()
    try:
        time.sleep(0.3)  # registered, gauges refreshed, nothing reaped yet
        assert metrics.instances._value.get() == 1
        assert [i.instance_id for i in index.list_instances("m", 4)] == ["quiet"]
        deadline = time.monotonic() + 3
        while metrics.dropped_instances.labels("heartbeat")._value.get() < 1:
            assert time.monotonic() < deadline, "never reaped"
            time.sleep(0.05)
        assert not redis_client.exists("pagoda:kv:m:4:inst:quiet:meta")
        time.sleep(0.2)
        assert metrics.instances._value.get() == 0
    finally:
        reaper.stop()
