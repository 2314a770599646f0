"""The gateway's own SIGTERM: in-flight streams finish (--shutdown-grace-period), then it
exits 0. The gateway runs as a real process (`pagoda gateway`) over a scripted, slow
replica, as a pod's gateway would when Kubernetes stops it."""

from __future__ import annotations

import json
import signal
import time

import httpx
from gateway_process import start_gateway_process

from pagoda.services._proto.pagoda.common.v1 import common_pb2 as cpb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.services.tokenizer.servicer import TokenizerServicer

NUM_TOKENS = 80  # 8 s: longer than the 5 s uvicorn gave in-flight requests before


class SlowReplica(spb_grpc.SchedulerServiceServicer):
    """One token every 0.1 s: a stream that lasts seconds."""

    def Generate(self, request, context):
        for i in range(request.sampling_params.max_tokens):
            yield spb.GenerateResponse(chunk=spb.GenerateChunk(token_ids=[504 + i % 50]))
            time.sleep(0.1)
        yield spb.GenerateResponse(complete=spb.GenerateComplete(
            finish_reason=cpb.FINISH_REASON_LENGTH))

    def GetModelInfo(self, request, context):
        return spb.GetModelInfoResponse(model="m", max_model_len=256, block_size=16,
                                        instance_id="slow", served_model_name=["m"])


def test_sigterm_lets_a_live_stream_finish(grpc_server_factory, smollm2_tokenizer):
    tokenizer = grpc_server_factory(tpb_grpc.add_TokenizerServiceServicer_to_server,
                                    TokenizerServicer(smollm2_tokenizer, "m", [2]))
    replica = grpc_server_factory(spb_grpc.add_SchedulerServiceServicer_to_server,
                                  SlowReplica())
    gateway, url = start_gateway_process(tokenizer.address, replica.address,
                                         "--shutdown-grace-period", "60")
    try:
        texts, finish, done = [], None, False
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "prompt": "Hi", "max_tokens": NUM_TOKENS, "stream": True}) as reply:
            lines = reply.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break  # the stream is live: now stop the gateway
            gateway.send_signal(signal.SIGTERM)
            for line in lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    texts += [c["text"] for c in event["choices"]]
                    finish = event["choices"][0]["finish_reason"] or finish
        assert done and finish == "length" and len(texts) >= NUM_TOKENS - 1
        assert gateway.wait(30) == 0, gateway.stderr.read()[-2000:]
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()

