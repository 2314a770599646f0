"""What the gateway's API servers (`--api-server-count N`) share, checked with two
objects on the same files, as two processes have them: stored responses (SQLite) and
runtime-loaded LoRA adapters (a JSON file), and the metrics summed over processes
(prometheus multiprocess mode, in real child processes)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from pagoda.services.gateway.lora.registry import LoRAModulePath, LoRARegistry
from pagoda.services.gateway.openai.responses_api.shared_store import FileResponseStore
from pagoda.services.gateway.openai.responses_api.store import StoredResponse


def run(call):
    return asyncio.run(call)


def item(text: str) -> StoredResponse:
    return StoredResponse({"id": text, "output_text": text}, [{"role": "user", "content": text}])


def test_a_response_stored_by_one_process_is_found_by_another(tmp_path):
    path = str(tmp_path / "responses.sqlite")
    first, second = FileResponseStore(path, 10), FileResponseStore(path, 10)
    run(first.put("resp_1", item("hello")))
    found = run(second.get("resp_1"))
    assert found is not None and found.response["output_text"] == "hello"
    assert found.messages == [{"role": "user", "content": "hello"}]
    assert run(second.get("resp_missing")) is None


def test_the_shared_store_keeps_capacity_dropping_the_least_recently_used(tmp_path):
    path = str(tmp_path / "responses.sqlite")
    first, second = FileResponseStore(path, 2), FileResponseStore(path, 2)
    run(first.put("a", item("a")))
    run(second.put("b", item("b")))
    assert run(first.get("a")) is not None  # a read counts as a use: b is now the oldest
    run(second.put("c", item("c")))
    assert len(first) == 2
    assert run(first.get("b")) is None
    assert run(second.get("a")) is not None and run(second.get("c")) is not None


def test_a_disabled_shared_store_stores_nothing(tmp_path):
    store = FileResponseStore(str(tmp_path / "r.sqlite"), 0)
    run(store.put("a", item("a")))
    assert run(store.get("a")) is None


def test_an_adapter_loaded_through_one_process_is_served_by_all(tmp_path):
    shared = str(tmp_path / "lora_adapters.json")
    static = [LoRAModulePath("sql", "/adapters/sql")]
    first = LoRARegistry(static, True, shared_file=shared)
    second = LoRARegistry(static, True, shared_file=shared)
    assert "sql" in second and "chat" not in second
    first.add("chat", "/adapters/chat")
    assert "chat" in second
    assert second.get("chat").lora_int_id == first.get("chat").lora_int_id
    assert second.remove("sql")
    assert "sql" not in first and "chat" in first
    assert [lora.lora_name for lora, _ in first.items()] == ["chat"]
    assert not first.remove("sql")  # already gone, through the other process


CHILD = textwrap.dedent("""
    import os, sys
    from pagoda.services.gateway.observability.metrics import gateway_metrics
    metrics = gateway_metrics()
    for _ in range(int(sys.argv[1])):
        metrics.observe_response("/v1/completions", "POST", 200, 0.01, True)
    metrics.in_flight.labels("/v1/completions").inc()  # one request still open
    print(os.getpid())
""")


def test_metrics_sum_over_processes_and_a_dead_ones_open_requests_leave(tmp_path):
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    pids = [int(subprocess.run([sys.executable, "-c", CHILD, str(k)], env=env, check=True,
                               capture_output=True, text=True).stdout) for k in (3, 4)]

    def samples() -> dict:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, str(tmp_path))
        return {(s.name, s.labels.get("route"), s.labels.get("status")): s.value
                for family in registry.collect() for s in family.samples}

    values = samples()
    assert values[("pagoda_gateway_http_requests_total", "/v1/completions", "200")] == 7
    assert values[("pagoda_gateway_http_request_duration_seconds_count", "/v1/completions",
                   None)] == 7
    assert values[("pagoda_gateway_requests_in_flight", "/v1/completions", None)] == 2
    mark_process_dead(pids[0], str(tmp_path))  # what the parent does when one exits
    values = samples()
    assert values[("pagoda_gateway_requests_in_flight", "/v1/completions", None)] == 1
    assert values[("pagoda_gateway_http_requests_total", "/v1/completions", "200")] == 7
