"""Readiness of a prefill/decode cluster means ready for P/D (issue 26).

* while the prefill replica is not up, the gateway's /health is 503 and says why; the very
  first request after it turns 200 (what `pagoda serve` waits for) is prefilled by the
  prefill replica;
* a prefill and a decode replica that cannot exchange blocks (another block size) make
  start-up fail, naming the field, instead of a healthy gateway that prefills locally;
* `--no-enable-prefix-caching` with P/D is refused before anything starts, saying why.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from pd_cluster import BASE, PREFILL_HEADER
from serve_cluster import CLI_MODULE, wait_until

from pagoda.services.cli import serve
from pagoda.services.cli.local_cluster import LocalCluster, ServiceFailed, ServiceProcess
from pagoda.free_ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
PROMPT = " ".join(f"token{i}" for i in range(40))  # more than a block: a lease is taken
HELD_S = 3.0  # > the gateway's health poll (1 s once ready, 0.2 s before)


def _services(model: str, redis_url: str, *extra: str) -> list[ServiceProcess]:
    """`pagoda serve --prefill-replicas 1 --decode-replicas 1 EXTRA`'s services."""
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", model, *BASE, "--port", str(free_port()),
                              "--disable-log-stats", "--prefill-replicas", "1",
                              "--decode-replicas", "1", *extra])
    return serve.build_services(args, redis_url)


def _health(base: str) -> httpx.Response | None:
    try:
        return httpx.get(f"{base}/health", timeout=2)
    except httpx.HTTPError:
        return None


def test_first_request_after_health_is_split(tiny_llama_dir, redis_server):
    """The prefill replica's scheduler starts only after the decode replica has served for
    a while: /health stays 503 (saying why) until the pair is checked, and the first
    request after it turns 200 is prefilled by the prefill replica."""
    services = _services(tiny_llama_dir, redis_server.url)
    by_name = {s.name: s for s in services}
    held = by_name["scheduler-prefill-0"]
    gateway = f"http://{by_name['gateway'].address}"
    with tempfile.NamedTemporaryFile("w+", prefix="pagoda-pd-ready-") as log:
        cluster = LocalCluster([s for s in services if s is not held], log_stream=log)
        cluster.start()
        try:
            assert wait_until(by_name["scheduler-decode-0"].is_healthy, 240, 0.25)
            time.sleep(HELD_S)  # the gateway has polled the decode replica serving
            reply = _health(gateway)
            assert reply is not None and reply.status_code == 503, reply
            assert "prefill" in reply.json()["reason"], reply.text
            cluster.services[held.name] = held
            cluster.restart(held.name)
            assert wait_until(lambda: (_health(gateway) or reply).status_code == 200, 240,
                              0.05)
            first = httpx.post(f"{gateway}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 4})
            assert first.status_code == 200, first.text
            assert PREFILL_HEADER in first.headers, dict(first.headers)
        finally:
            cluster.stop()


def _mismatched_cluster(model: str, redis_url: str, log) -> LocalCluster:
    """`pagoda serve --prefill-replicas 1 --decode-replicas 1`'s services, the prefill
    replica's with --block-size 32 (the decode replica keeps 16)."""
    services = _services(model, redis_url)
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
