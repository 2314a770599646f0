"""A scripted fake scheduler and an in-thread gateway, for the gateway tests."""

from __future__ import annotations

import threading
import time

import grpc
from app_server import AppServer

from pagoda.services._proto.pagoda.common.v1 import common_pb2 as cpb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services.gateway.app import create_app

SCRIPT = " The answer is forty two. END of the story, and then some more words follow here."
BAD_TOKEN = 7  # a prompt starting with it is rejected by the fake scheduler
MAX_MODEL_LEN = 256


class FakeScheduler(spb_grpc.SchedulerServiceServicer):
    """Answers every request with SCRIPT's tokens, one per chunk, up to max_tokens."""

    def __init__(self, tokenizer) -> None:
        self.script = tokenizer.encode(SCRIPT, add_special_tokens=False)
        self.requests: list[spb.GenerateRequest] = []
        self.cancelled: set[str] = set()
        self.fail_after: int | None = None  # tokens before the stream fails UNAVAILABLE

    def Generate(self, request, context):
        self.requests.append(request)
        rid = request.request_id
        done = threading.Event()
        context.add_callback(lambda: None if done.is_set() else self.cancelled.add(rid))
        if request.prompt_token_ids[0] == BAD_TOKEN:
            done.set()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Token id 7 is not allowed here.")
        n = request.sampling_params.max_tokens
        for i in range(n):
            if self.fail_after is not None and i == self.fail_after:
                done.set()
                context.abort(grpc.StatusCode.UNAVAILABLE, "replica failed: worker gone")
            token = self.script[i % len(self.script)]
            yield spb.GenerateResponse(chunk=spb.GenerateChunk(token_ids=[token]))
            time.sleep(0.002)
        done.set()
        yield spb.GenerateResponse(complete=spb.GenerateComplete(
            finish_reason=cpb.FINISH_REASON_LENGTH))

    def GetModelInfo(self, request, context):
        return spb.GetModelInfoResponse(model="/models/fake", max_model_len=MAX_MODEL_LEN,
                                        block_size=16, served_model_name=["fake-model"])


class Gateway:
    def __init__(self, url: str, scheduler: FakeScheduler) -> None:
        self.url = url
        self.scheduler = scheduler


def run_gateway(tokenizer_addr: str, scheduler_addr: str, api_key: str | None = None
                ) -> AppServer:
    """The gateway over one tokenizer and one scheduler, healthy."""
    return AppServer(create_app(tokenizer_addr, [scheduler_addr], None, api_key))
