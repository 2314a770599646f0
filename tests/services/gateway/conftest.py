"""The gateway over a real tokenizer servicer and a scripted fake scheduler."""

from __future__ import annotations

import pytest
from gateway_harness import FakeScheduler, Gateway, run_gateway

from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.services.tokenizer.servicer import TokenizerServicer


@pytest.fixture(scope="module")
def peers(smollm2_tokenizer, grpc_server_factory_module):
    """(tokenizer address, scheduler address, fake scheduler)."""
    tokenizer = grpc_server_factory_module(tpb_grpc.add_TokenizerServiceServicer_to_server,
                                           TokenizerServicer(smollm2_tokenizer, "smollm2", [2]))
    fake = FakeScheduler(smollm2_tokenizer)
    scheduler = grpc_server_factory_module(spb_grpc.add_SchedulerServiceServicer_to_server, fake)
    return tokenizer.address, scheduler.address, fake


@pytest.fixture(scope="module")
def gateway(peers):
    server = run_gateway(peers[0], peers[1])
    yield Gateway(server.url, peers[2])
    server.stop()
