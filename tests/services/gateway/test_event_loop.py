"""The gateway's event loop (services/gateway/event_loop.py): uvloop when installed, as
vLLM's API server, and asyncio's with PAGODA_GATEWAY_UVLOOP=0. The served test runs the
real `pagoda gateway` process: its gRPC channels (grpc.aio) stream a completion over the
loop it names, and a stream the client drops is cancelled at the scheduler."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from gateway_harness import SCRIPT, FakeScheduler
from gateway_process import start_gateway_process

from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.services.gateway import event_loop
from pagoda.services.tokenizer.servicer import TokenizerServicer


def test_uvloop_is_installed_and_picked(monkeypatch):
    """uvloop is a dependency (requirements.lock): a missing wheel fails here, not
    silently as a slower gateway."""
    import uvloop  # noqa: F401
    monkeypatch.delenv("PAGODA_GATEWAY_UVLOOP", raising=False)
    assert event_loop.loop_name() == "uvloop"
    monkeypatch.setenv("PAGODA_GATEWAY_UVLOOP", "0")
    assert event_loop.loop_name() == "asyncio"


class _PacedScheduler(FakeScheduler):
    """FakeScheduler at 50 ms a token: a dropped stream is still running when the
    gateway sees its client leave (at 2 ms a token it could end first, cancelled or not)."""

    def Generate(self, request, context):
        for response in super().Generate(request, context):
            yield response
            time.sleep(0.05)


@pytest.fixture(scope="module")
def peers(smollm2_tokenizer, grpc_server_factory_module):
    tokenizer = grpc_server_factory_module(tpb_grpc.add_TokenizerServiceServicer_to_server,
                                           TokenizerServicer(smollm2_tokenizer, "m", [2]))
    fake = _PacedScheduler(smollm2_tokenizer)
    scheduler = grpc_server_factory_module(spb_grpc.add_SchedulerServiceServicer_to_server, fake)
    return tokenizer.address, scheduler.address, fake


@pytest.mark.parametrize("setting,loop", [("1", "uvloop.Loop"), ("0", "asyncio.")])
def test_gateway_process_streams_and_cancels_on_its_loop(peers, setting, loop):
    tokenizer_addr, scheduler_addr, fake = peers
    gateway, url = start_gateway_process(
        tokenizer_addr, scheduler_addr,
        env={"PAGODA_GATEWAY_UVLOOP": setting, "PAGODA_LOG_LEVEL": "INFO"})
    try:
        # A whole stream, byte for byte what the fake scheduler scripted.
        text, done = "", False
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30, json={
                "prompt": "Hi", "max_tokens": 8, "stream": True}) as reply:
            for line in reply.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert done and SCRIPT.startswith(text) and len(text) > 8, text
        # A stream the client drops after its first chunk is cancelled at the scheduler.
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30, json={
                "prompt": "Hi", "max_tokens": 200, "stream": True}) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    break
        dropped = fake.requests[-1].request_id
        deadline = time.monotonic() + 30
        while dropped not in fake.cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dropped in fake.cancelled
    finally:
        gateway.terminate()
        gateway.wait(30)
    log = gateway.stderr.read()
    assert f"event loop: {loop}" in log, log[-2000:]

