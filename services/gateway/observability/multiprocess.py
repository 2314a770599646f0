"""`/metrics` summed over the gateway's API-server processes (`--api-server-count N`),
the way vLLM does it: prometheus_client's multiprocess mode.

The parent (api_servers.py) names an empty directory in `PROMETHEUS_MULTIPROC_DIR`
before any API server starts; every metric an API server updates then lives in
mmap'd files there (one per process and kind), and `/metrics`, whichever process
answers it, reads them all (`MultiProcessCollector`). Invariants:
  * the same metric names as with one process, each series once (summed over the
    processes, no `pid` label): k requests over N processes read k;
  * counters and histograms sum over every process that ever ran, a restarted
    one's dead predecessor included, so a total never goes back;
  * gauges follow their `multiprocess_mode`: requests in flight `livesum` (live
    processes only: the parent calls `mark_dead(pid)` for one that exited, as
    vLLM's does), a peer's scrape status `mostrecent`.
With one process (the default) none of this runs: `/metrics` reads the default
registry as before, process_* and python_* series included (which the multiprocess
collector does not carry, in vLLM neither).
"""

from __future__ import annotations

import glob
import os

from prometheus_client import REGISTRY, CollectorRegistry, values
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from pagoda.services.common.metrics_server import one_per_process

ENV = "PROMETHEUS_MULTIPROC_DIR"


def enabled() -> bool:
    return bool(os.environ.get(ENV))


@one_per_process
def _multiprocess_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # reads the directory at every collect()
    return registry


def metrics_registry() -> CollectorRegistry:
    """What `/metrics` renders as this gateway's own metrics: every API server's,
    summed, under `--api-server-count` > 1; else this process's default registry."""
    return _multiprocess_registry() if enabled() else REGISTRY


def prepare_directory(path: str) -> None:
    """Make `path` the multiprocess directory of this process and its children: files
    left by an earlier run would be summed in, so they go. Call before any metric
    of this process is created (its values then go to the directory too)."""
    os.makedirs(path, exist_ok=True)
    for stale in glob.glob(os.path.join(path, "*.db")):
        os.remove(stale)
    os.environ[ENV] = path
    # prometheus_client chose its value class when it was imported, before the
    # variable was set; the metrics this process creates from now on use the files.
    values.ValueClass = values.get_value_class()


def mark_dead(pid: int) -> None:
    """An API server exited: its live gauges (requests in flight) leave the sums."""
    mark_process_dead(pid, os.environ[ENV])
