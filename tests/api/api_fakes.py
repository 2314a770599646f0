"""A scripted scheduler and an in-thread gateway, for the API tests that need no model.

The fake answers every request with SCRIPT's tokens (up to max_tokens), and, when
asked, with logprobs a test can predict: at output position i the chosen token
has logprob `-0.25 * (i + 1)` and rank 1, and the top-k are the chosen token then
`chosen + 1, chosen + 2, ...` with logprobs one lower each. Prompt logprobs arrive
in their own message before the first token (as a chunked prefill would send them).
Magic first prompt tokens script failures.
"""

from __future__ import annotations

import threading
import time

import grpc
from app_server import AppServer
from grpc_servers import start_grpc_server

from pagoda.services._proto.pagoda.common.v1 import common_pb2 as cpb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.services.gateway.app import create_app
from pagoda.services.tokenizer.servicer import TokenizerServicer

SCRIPT = " The answer is forty two. END of the story, and then some more words follow here."
MAX_MODEL_LEN = 256
MODEL = "fake-model"
# A prompt starting with one of these makes the fake fail.
QUEUE_FULL_TOKEN = 8  # RESOURCE_EXHAUSTED on submission (a full waiting queue)
ENGINE_ERROR_TOKEN = 9  # INTERNAL on submission (a bug inside the engine)


def output_logprob(i: int) -> float:
    return -0.25 * (i + 1)


def prompt_logprob(position: int) -> float:
    return -1.0 - position / 8  # exact in float32 (logprobs travel as floats)


def logprob_row(chosen: int, logprob: float, k: int) -> cpb.LogprobsRow:
    ids = [chosen] + [chosen + j for j in range(k)]
    return cpb.LogprobsRow(token_ids=ids, logprobs=[logprob] + [logprob - j for j in range(k)],
                           ranks=[1] + list(range(1, k + 1)))


class FakeScheduler(spb_grpc.SchedulerServiceServicer):
    """Answers with SCRIPT's tokens, one per chunk; records requests and cancellations."""

    def __init__(self, tokenizer) -> None:
        self.script = tokenizer.encode(SCRIPT, add_special_tokens=False)
        self.requests: list[spb.GenerateRequest] = []
        self.cancelled: set[str] = set()
        self.fail_after: int | None = None  # output tokens before the stream fails INTERNAL
        self.delay_s = 0.002

    def Generate(self, request, context):
        self.requests.append(request)
        rid, params = request.request_id, request.sampling_params
        done = threading.Event()
        context.add_callback(lambda: None if done.is_set() else self.cancelled.add(rid))
        first = request.prompt_token_ids[0]
        if first == QUEUE_FULL_TOKEN:
            done.set()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue is full (2)")
        if first == ENGINE_ERROR_TOKEN:
            done.set()
            context.abort(grpc.StatusCode.INTERNAL, "engine exploded")
        if params.HasField("prompt_logprobs"):
            yield self._prompt_logprobs(request.prompt_token_ids, params.prompt_logprobs)
        for i in range(params.max_tokens):
            if self.fail_after is not None and i == self.fail_after:
                done.set()
                context.abort(grpc.StatusCode.INTERNAL, "worker step failed")
            token = self.script[i % len(self.script)]
            chunk = spb.GenerateChunk(token_ids=[token])
            if params.HasField("logprobs"):
                chunk.logprobs.rows.append(logprob_row(token, output_logprob(i), params.logprobs))
            yield spb.GenerateResponse(chunk=chunk)
            time.sleep(self.delay_s)
        done.set()
        yield spb.GenerateResponse(complete=spb.GenerateComplete(
            finish_reason=cpb.FINISH_REASON_LENGTH))

    @staticmethod
    def _prompt_logprobs(prompt: list[int], k: int) -> spb.GenerateResponse:
        chunk = spb.GenerateChunk()
        for position in range(1, len(prompt)):
            chunk.prompt_logprobs.rows.append(logprob_row(prompt[position],
                                                          prompt_logprob(position), k))
        return spb.GenerateResponse(chunk=chunk)

    def GetModelInfo(self, request, context):
        return spb.GetModelInfoResponse(model="/models/fake", max_model_len=MAX_MODEL_LEN,
                                        block_size=16, served_model_name=[MODEL])

    def GetLoad(self, request, context):
        return spb.GetLoadResponse(serving=True)


class RecordingTokenizer(TokenizerServicer):
    """The real tokenizer servicer, recording the decode options each completion opens
    with (what reaches the tokenizer of a request's sampling params)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, "smollm2", [2])
        self.decode_options: list[tpb.DecodeOptions] = []

    def _decode_one(self, decoders, item, *rest):
        if item.HasField("options"):
            self.decode_options.append(item.options)
        return super()._decode_one(decoders, item, *rest)


class Peers:
    """A real tokenizer servicer and the fake scheduler on in-process gRPC servers; with
    `media` (a tokenizer service's MediaPreprocessor) the tokenizer preprocesses images of
    the model in `model_dir`."""

    def __init__(self, tokenizer, model_dir: str | None = None, media=None) -> None:
        self.scheduler = FakeScheduler(tokenizer)
        self.tokenizer = RecordingTokenizer(tokenizer)
        if model_dir is not None:
            self.tokenizer.model = model_dir
        if media is not None:
            self.tokenizer.media = media
        self._servers = []
        self.tokenizer_addr = self._serve(tpb_grpc.add_TokenizerServiceServicer_to_server,
                                          self.tokenizer)
        self.scheduler_addr = self._serve(spb_grpc.add_SchedulerServiceServicer_to_server,
                                          self.scheduler)

    def _serve(self, add_fn, servicer) -> str:
        server, address = start_grpc_server(add_fn, servicer, max_workers=16)
        self._servers.append(server)
        return address

    def stop(self) -> None:
        for server in self._servers:
            server.stop(None)


class Gateway(AppServer):
    """The gateway app under uvicorn in a thread, pointed at `peers`."""

    def __init__(self, peers: Peers, **app_kwargs) -> None:
        self.peers = peers
        self.scheduler = peers.scheduler
        super().__init__(create_app(peers.tokenizer_addr, [peers.scheduler_addr], **app_kwargs))
