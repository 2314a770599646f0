"""Readiness of a prefill/decode cluster means ready for P/D (issue 26).

* the very first request after `pagoda serve` says it serves (its gateway's /health is 200)
  is prefilled by the prefill replica;
* a prefill and a decode replica that cannot exchange blocks (another block size) make
  start-up fail, naming the field, instead of a healthy gateway that prefills locally;
* `--no-enable-prefix-caching` with P/D is refused before anything starts, saying why.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

import httpx
import pytest
from pd_cluster import BASE, PREFILL_HEADER, metric
from serve_cluster import CLI_MODULE, ServeProcess

from pagoda.services.cli import serve
from pagoda.services.cli.local_cluster import LocalCluster, ServiceFailed
from pagoda.services.common.redis_server import free_port

pytestmark = pytest.mark.slow
PROMPT = " ".join(f"token{i}" for i in range(40))  # more than a block: a lease is taken


def test_first_request_after_ready_is_split(tiny_llama_dir, redis_server):
    serve_process = ServeProcess([tiny_llama_dir, *BASE, "--redis-url", redis_server.url,
                                  "--prefill-replicas", "1", "--decode-replicas", "1"])
    try:
        assert httpx.get(f"{serve_process.base}/health", timeout=10).status_code == 200
        reply = httpx.post(f"{serve_process.base}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert PREFILL_HEADER in reply.headers, dict(reply.headers)
        assert metric(serve_process, "pagoda_gateway_disagg_fallbacks_total") == 0
    finally:
        code = serve_process.stop()
    assert code == 0, serve_process.stderr_text()[-3000:]


def _mismatched_cluster(model: str, redis_url: str, log) -> LocalCluster:
    """`pagoda serve --prefill-replicas 1 --decode-replicas 1`'s services, the prefill
    replica's with --block-size 32 (the decode replica keeps 16)."""
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", model, *BASE, "--port", str(free_port()),
                              "--disable-log-stats", "--prefill-replicas", "1",
                              "--decode-replicas", "1"])
    services = serve.build_services(args, redis_url)
    for service in services:
        if service.name in ("scheduler-prefill-0", "gpu-worker-prefill-0"):
            service.argv += ["--block-size", "32"]  # the last value wins
    return LocalCluster(services, log_stream=log)


def test_mismatched_pair_fails_start_up_naming_the_field(tiny_llama_dir, redis_server):
    with tempfile.NamedTemporaryFile("w+", prefix="pagoda-pd-mismatch-") as log:
        cluster = _mismatched_cluster(tiny_llama_dir, redis_server.url, log)
        cluster.start()
        try:
            with pytest.raises(ServiceFailed) as failed:
                cluster.wait_healthy(240)
        finally:
            cluster.stop()
        log.seek(0)
        text = log.read()
    assert failed.value.service.name == "gateway", text[-3000:]
    assert "block_size 32 vs 16" in str(failed.value), str(failed.value)
    assert "cannot exchange KV blocks" in str(failed.value)


def test_prefix_caching_off_with_pd_is_refused(tiny_llama_dir):
    try:
        done = subprocess.run(
            [sys.executable, "-m", CLI_MODULE, "serve", tiny_llama_dir, *BASE, "--port",
             str(free_port()), "--prefill-replicas", "1", "--decode-replicas", "1",
             "--no-enable-prefix-caching"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:  # it started the cluster instead
        raise AssertionError("pagoda serve started a P/D cluster without the prefix cache"
                             ) from exc
    assert done.returncode == 2, done.stderr[-3000:]
    assert "--no-enable-prefix-caching" in done.stderr
    assert "prefix cache" in done.stderr and "block hashes" in done.stderr
