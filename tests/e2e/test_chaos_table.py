"""Issue 33's table: any one component may die, or hang, and no client notices.

For each component of `pagoda serve` (the tiny model, a private supervised Redis, the
default kv_aware router, two tokenizer replicas): 600 streams at concurrency 64 through
the official openai client, the component SIGKILLed a third of the way in; then a run
freezing it with SIGSTOP for 10 s instead. Each run: 0 lost, 0 hung, 0 errors, KV usage
back to 0 on /metrics, /health 200 afterwards; each prints its table row (component,
fault, completed, errors, restarts; `pytest -s` shows them).

Colocated rows share one `--data-parallel-size 2` cluster (a killed component is back,
restarted by `pagoda serve`, before the next row starts); the prefill replica's
gpu-worker rows run on a 1P+1D cluster, and "one gateway process of two" on a cluster
with `--api-server-count 2` (its own bar: only the streams open on the killed process
may fail, each with a clean connection error).

Soak (`make test-chaos`): about 15 minutes on a 2-core machine.
"""

from __future__ import annotations

import httpx
import pytest
from chaos_table import GATEWAY_PROCESS, HEADER, check_row, indexed_blocks, run_row
from serve_cluster import ServeProcess, wait_until

# A row: 600 streams, the fault, its recovery and checks (several minutes on 2 cores).
pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(1500)]

COLOCATED = ["gpu-worker", "scheduler", "tokenizer", "kv-cache-manager", "redis"]
FAULTS = ["SIGKILL", "SIGSTOP"]
BASE_FLAGS = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512",
              "--restart-backoff", "0.5"]


def serving(serve: ServeProcess, replicas: int) -> bool:
    """Whether every replica takes requests again (`x-pagoda-instance` seen `replicas`
    times over a few requests)."""
    seen: set[str] = set()
    for _ in range(8 * replicas):
        try:
            reply = httpx.post(f"{serve.url}/completions", timeout=30,
                               json={"model": "tiny", "prompt": f"warm {len(seen)}",
                                     "max_tokens": 1})
        except httpx.HTTPError:
            return False
        if reply.status_code != 200:
            return False
        seen.add(reply.headers.get("x-pagoda-instance", ""))
    return len(seen - {""}) >= replicas


def resync_count(serve: ServeProcess) -> float:
    return sum(v for (name, _), v in serve.scrape().items()
               if name == "pagoda_kv_index_resyncs_total")


@pytest.fixture(scope="module")
def colocated(tiny_llama_dir):
    serve = ServeProcess([tiny_llama_dir, *BASE_FLAGS, "--data-parallel-size", "2"])
    print("\n" + HEADER, flush=True)
    yield serve
    serve.stop()


@pytest.fixture(scope="module")
def disaggregated(tiny_llama_dir):
    serve = ServeProcess([tiny_llama_dir, *BASE_FLAGS, "--prefill-replicas", "1",
                          "--decode-replicas", "1"])
    yield serve
    serve.stop()


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("component", COLOCATED)
def test_colocated_component(colocated, component, fault):
    assert wait_until(lambda: serving(colocated, 2), 120, interval=1), "cluster not back"
    resyncs = resync_count(colocated)
    check_row(colocated, run_row(colocated, component, fault))
    if component == "redis" and fault == "SIGKILL":
        # It came back empty: the schedulers sent snapshots (resyncs), and the index holds
        # the prompts served before the restart again.
        assert wait_until(lambda: resync_count(colocated) > resyncs, 30, interval=1)
    if component in ("kv-cache-manager", "redis"):
        assert wait_until(lambda: indexed_blocks(colocated) >= 2, 30, interval=1), \
            "the prefix index was not rebuilt from the schedulers"


@pytest.mark.parametrize("fault", FAULTS)
def test_prefill_replica_gpu_worker(disaggregated, fault):
    assert wait_until(lambda: serving(disaggregated, 1), 120, interval=1), "cluster not back"
    check_row(disaggregated, run_row(disaggregated, "prefill gpu-worker", fault))


@pytest.fixture(scope="module")
def two_api_servers(tiny_llama_dir):
    serve = ServeProcess([tiny_llama_dir, *BASE_FLAGS, "--api-server-count", "2"])
    yield serve
    serve.stop()


@pytest.mark.parametrize("fault", FAULTS)
def test_one_gateway_process_of_two(two_api_servers, fault):
    assert wait_until(lambda: len(two_api_servers.api_server_pids()) == 2
                      and serving(two_api_servers, 1), 120, interval=1), "cluster not back"
    check_row(two_api_servers, run_row(two_api_servers, GATEWAY_PROCESS, fault))
