"""The five services end to end on a tiny random Llama, through the official openai client."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis
from serve_cluster import flag_value, scheduler_load, wait_until

from pagoda.config import DEFAULT_PREFIX_HASH_SEED
from pagoda.core.block_hash import hash_request_tokens
from pagoda.services.bench.startup import services_from_log
from pagoda.free_ports import free_port
from pagoda.services.common.startup_clock import parse_report
from pagoda.services.kv_cache_manager.index import PrefixIndex

pytestmark = pytest.mark.slow
GREEDY = dict(temperature=0.0, max_tokens=24)


def test_models_list(tiny_client):
    models = tiny_client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].model_extra["max_model_len"] == 1024


def test_sleep_endpoints_are_404_without_enable_sleep_mode(tiny_cluster):
    """As vLLM: /sleep, /wake_up and /is_sleeping exist only with --enable-sleep-mode
    (test_sleep_served.py serves them), and no replica was put to sleep."""
    base = tiny_cluster.base
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        assert httpx.request(method, f"{base}{path}", timeout=30).status_code == 404, path
    out = openai.OpenAI(base_url=tiny_cluster.url, api_key="unused", max_retries=0,
                        timeout=120).completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert out.choices[0].text is not None


def test_completion_streamed_equals_non_streamed(tiny_client):
    whole = tiny_client.completions.create(model="tiny", prompt="The capital of France", **GREEDY)
    chunks = list(tiny_client.completions.create(model="tiny", prompt="The capital of France",
                                                 stream=True, **GREEDY,
                                                 stream_options={"include_usage": True}))
    assert whole.choices[0].text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_chat_streamed_equals_non_streamed(tiny_client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name three colours."}]
    whole = tiny_client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    chunks = list(tiny_client.chat.completions.create(model="tiny", messages=messages,
                                                      stream=True, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_usage_counts_match_the_tokens(tiny_client, tiny_cluster):
    prompt = "Once upon a time there was"
    out = tiny_client.completions.create(model="tiny", prompt=prompt, max_tokens=17,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    count = httpx.post(f"{tiny_cluster.url[:-3]}/tokenize", json={"prompt": prompt}).json()["count"]
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == \
        (count, 17, count + 17)


def test_concurrent_streams_each_get_their_own_text(tiny_client):
    prompts = [f"Story number {i}: the {w}" for i, w in
               enumerate(["cat", "dog", "ship", "moon", "tree", "river", "king", "robot"] * 2)]
    expected = [tiny_client.completions.create(model="tiny", prompt=p, **GREEDY).choices[0].text
                for p in prompts]

    def stream(prompt: str) -> str:
        chunks = tiny_client.completions.create(model="tiny", prompt=prompt, stream=True, **GREEDY)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(max_workers=16) as pool:
        got = list(pool.map(stream, prompts))
    assert got == expected
    assert len(set(expected)) > 1  # different prompts really gave different texts


def test_kv_cache_manager_records_the_scheduler_blocks(tiny_client, tiny_cluster, redis_server):
    prompt_ids = list(range(1000, 1000 + 40))  # 2 full blocks of 16
    tiny_client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=2)
    scheduler = tiny_cluster.service_args("scheduler")
    instance = f"127.0.0.1:{flag_value(scheduler, '--port')}"
    model = flag_value(scheduler, "--model")
    hashes = hash_request_tokens(prompt_ids, 16, DEFAULT_PREFIX_HASH_SEED)
    index = PrefixIndex(redis.Redis.from_url(redis_server.url))
    # Events are batched off the step's critical path: give them a moment.
    assert wait_until(lambda: index.lookup(model, 16, hashes).get(instance) == 2, timeout=10)


def test_gateway_stops_cleanly_on_sigterm(tiny_cluster, tiny_client):
    """A second gateway on the same peers: SIGTERM makes it exit 0, mid-stream or not."""
    gateway = tiny_cluster.service_args("gateway")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "pagoda.services.cli.main", "gateway", "--port", str(port),
         "--tokenizer-addr", flag_value(gateway, "--tokenizer-addr"),
         "--scheduler-addrs", flag_value(gateway, "--scheduler-addrs")],
        stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _healthy(url), timeout=60)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert client.completions.create(model="tiny", prompt="Hi", max_tokens=4).choices
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
        assert "Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
    # The cluster's own gateway is unaffected.
    assert tiny_client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_bench_serve_prints_one_json_line(tiny_cluster):
    out = subprocess.run(
        [sys.executable, "-m", "pagoda.services.cli.main", "bench", "serve", "--base-url",
         tiny_cluster.url[:-3], "--num-prompts", "6", "--max-concurrency", "3",
         "--random-input-len", "20", "--random-output-len", "8"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["completed"] == 6 and result["failed"] == 0
    for key in ("output_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms",
                "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms"):
        assert result[key] > 0
    # ignore_eos: every request produced exactly the asked number of tokens.
    assert result["total_output_tokens"] == 6 * 8
    assert result["base_url"] == tiny_cluster.url[:-3] and result["model_id"] == "tiny"


def _scheduler_load(cluster):
    """() -> the cluster's scheduler's GetLoadResponse."""
    address = cluster.scheduler_address()
    return lambda: scheduler_load(address)


def _aborted(cluster) -> float:
    """Requests the engine ended as aborted so far (vLLM's counter, merged by the gateway)."""
    return sum(v for (name, labels), v in cluster.scrape().items()
               if name == "vllm:request_success_total" and ("finished_reason", "abort") in labels)


def test_client_disconnect_aborts_the_request(tiny_cluster):
    """A streaming client that closes its connection mid-stream aborts its request: the
    engine counts it as aborted (it would otherwise end by length after 1000 tokens) and
    the scheduler holds nothing afterwards."""
    load = _scheduler_load(tiny_cluster)
    aborted_before = _aborted(tiny_cluster)
    body = {"model": "tiny", "prompt": "Go on forever", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{tiny_cluster.url}/completions", json=body, timeout=60) as resp:
        chunks = (line for line in resp.iter_lines() if line.startswith("data: "))
        for _ in range(10):
            next(chunks)
        assert load().num_running == 1
    # The connection is closed: the gateway cancels the scheduler stream, which aborts.
    assert wait_until(lambda: load().num_running == 0, timeout=60)
    assert wait_until(lambda: _aborted(tiny_cluster) == aborted_before + 1, timeout=30)
    assert load().num_waiting == 0


def test_non_streamed_request_is_aborted_when_its_client_leaves(tiny_cluster):
    """The same for a non-streamed request: the client leaves while the engine runs it."""
    load = _scheduler_load(tiny_cluster)
    payload = json.dumps({"model": "tiny", "prompt": "Go on", "max_tokens": 1000,
                          "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", tiny_cluster.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    # Leave only once the engine is generating for it (no race with admission).
    assert wait_until(lambda: load().num_running == 1, timeout=60)
    sock.close()
    assert wait_until(lambda: load().num_running == 0, timeout=60)
    # Nothing is held afterwards. (Whether it ended as aborted or ran out its 1000 tokens
    # first depends on machine speed; the streamed test above checks the abort itself.)
    assert wait_until(lambda: load().kv_cache_usage == 0, timeout=30)


def test_every_service_logs_where_its_start_up_went(tiny_cluster):
    """Each service's `start-up:` line (what `pagoda bench startup` reads): its phases,
    in order and summing to no more than its total."""
    services = services_from_log([(0.0, line) for line in tiny_cluster.log], spawned=0.0)
    assert set(services) >= {"pagoda serve", "gateway", "tokenizer", "scheduler", "gpu-worker",
                             "kv-cache-manager"}, services
    assert list(services["gpu-worker"]["phases"]) == ["imports", "engine config", "model load",
                                                      "gRPC server"]
    assert "worker and KV cache" in services["scheduler"]["phases"]
    reports = [parse_report(line) for line in tiny_cluster.log if parse_report(line)]
    for phases, what, total in reports:
        assert sum(phases.values()) <= total + 0.05, (phases, what, total)
