"""A replica that stops answering mid-stream (SIGSTOP: its process frozen, its sockets
open) loses its streams to the other replica within seconds, not after the gateway's
300 s read bound: the gateway's keepalive pings find a frozen scheduler, the scheduler's
keepalive pings and step deadline a frozen gpu-worker (then the scheduler ends its
streams for migration, as for a dead worker).

Real processes: `pagoda serve --data-parallel-size 2` with the tiny model. A greedy
request streams from one replica; after its first tokens that replica's scheduler (or
gpu-worker) is frozen; the client must get one stream whose text equals the request's
un-migrated text, and the gateway must count a migration.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import psutil
import pytest
from serve_cluster import ServeProcess, flag_value

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended

PROMPT = "Story: once upon a time in a land of copper,"
MAX_TOKENS = 800
# Detects a hang, not a speed: the freeze must be found in seconds (keepalive ~10 s),
# and the rest of the request then streams from the other replica.
STREAM_BOUND_S = 90.0


def greedy(**extra) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0.0, **extra}


@pytest.fixture
def cluster(tiny_llama_dir, redis_server):
    """start(*flags) -> (the cluster, the pids the test froze): thawed, then stopped."""
    started: list[tuple[ServeProcess, list[int]]] = []

    def start(*flags: str) -> tuple[ServeProcess, list[int]]:
        serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype",
                              "float32", "--max-model-len", "1024", "--redis-url",
                              redis_server.url, "--data-parallel-size", "2", "--router",
                              "round_robin", "--disable-log-stats", *flags])
        started.append((serve, []))
        return started[-1]

    yield start
    for serve, frozen in started:
        _thaw_and_stop(serve, frozen)


def _thaw_and_stop(serve: ServeProcess, frozen: list[int]) -> None:
    for pid in frozen:  # thaw before stopping, or the supervisor waits on a stopped child
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    serve.stop()


def replica_pid(serve: ServeProcess, instance: str, kind: str) -> int:
    """The pid of `kind` ("scheduler" or "gpu-worker") in the replica whose scheduler
    listens at `instance` (its instance id is its host:port)."""
    port = instance.rsplit(":", 1)[1]
    scheduler = next(pid for pid in _children(serve, "scheduler")
                     if flag_value(_argv(pid), "--port") == port)
    if kind == "scheduler":
        return scheduler
    worker_port = flag_value(_argv(scheduler), "--worker-addr").rsplit(":", 1)[1]
    return next(pid for pid in _children(serve, "gpu-worker")
                if flag_value(_argv(pid), "--port") == worker_port)


def _children(serve: ServeProcess, name: str) -> list[int]:
    out = []
    for child in psutil.Process(serve.process.pid).children(recursive=True):
        argv = child.cmdline()
        if "pagoda.services.cli.main" in argv and name in argv:
            out.append(child.pid)
    return out


def _argv(pid: int) -> list[str]:
    return psutil.Process(pid).cmdline()


def stream_and_freeze(serve: ServeProcess, frozen: list[int], kind: str) -> tuple[str, str]:
    """(text, finish_reason) of a streamed greedy request whose replica's `kind` is
    frozen after the first tokens arrived."""
    text, finish = [], None
    with httpx.stream("POST", f"{serve.url}/completions", json=greedy(stream=True),
                      timeout=STREAM_BOUND_S) as reply:
        assert reply.status_code == 200
        instance = reply.headers["x-pagoda-instance"]
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
            if not frozen and len(text) >= 3:
                pid = replica_pid(serve, instance, kind)
                os.kill(pid, signal.SIGSTOP)
                frozen.append(pid)
                frozen_at = time.monotonic()
    assert frozen, "the request ended before its replica could be frozen"
    print(f"{kind} frozen; the stream ended {time.monotonic() - frozen_at:.1f} s later")
    return "".join(text), finish


def migrations_by_reason(serve: ServeProcess) -> dict[str, float]:
    return {dict(labels)["reason"]: value for (name, labels), value in serve.scrape().items()
            if name == "pagoda_gateway_migrations_total"}


# (what is frozen, flags, the migration reason the gateway must count, what the log must
# say about how the freeze was found)
CASES = {
    # The gateway's keepalive ping goes unanswered: its stream fails UNAVAILABLE.
    "scheduler": ("scheduler", [], "replica_lost", "lost a request (UNAVAILABLE"),
    # The scheduler's keepalive ping to its worker goes unanswered: the step fails, the
    # engine fails, its streams end for migration (as for a dead worker).
    "gpu-worker": ("gpu-worker", [], "replica_failed", "ExecuteModel: UNAVAILABLE"),
    # No keepalive: only the step deadline finds the frozen worker.
    "gpu-worker-step-deadline": ("gpu-worker", ["--grpc-keepalive-time", "0",
                                                "--execute-model-timeout", "5"],
                                 "replica_failed", "ExecuteModel: DEADLINE_EXCEEDED"),
}


# A minute each on a 2-core machine: `make test` freezes a gpu-worker (found by keepalive);
# `make test-chaos` (the soak marker) also freezes a scheduler and a worker without keepalive.
SOAK_CASES = {"scheduler", "gpu-worker-step-deadline"}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.soak)
                                  if case in SOAK_CASES else case for case in sorted(CASES)])
def test_a_frozen_replica_loses_its_stream_to_the_other(cluster, case):
    kind, flags, reason, found_by = CASES[case]
    serve, frozen = cluster(*flags)
    reply = httpx.post(f"{serve.url}/completions", json=greedy(), timeout=120)
    assert reply.status_code == 200, reply.text
    expected = reply.json()["choices"][0]["text"]
    before = migrations_by_reason(serve).get(reason, 0)

    started = time.monotonic()
    try:
        text, finish = stream_and_freeze(serve, frozen, kind)
    except (AssertionError, httpx.HTTPError) as exc:
        raise AssertionError(f"{exc!r}\n" + "".join(serve.log[-80:])) from None
    assert time.monotonic() - started < STREAM_BOUND_S
    assert finish == "length"
    assert text == expected
    assert migrations_by_reason(serve).get(reason, 0) == before + 1
    assert any(found_by in line for line in serve.log), "".join(serve.log[-40:])
