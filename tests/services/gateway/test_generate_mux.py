"""The gateway's side of `GenerateStream` (routing/generate_mux.py), through
`SchedulerReplica.generate` against scripted replicas: what the rest of the gateway
sees is what per-request `Generate` gave it (outputs, ReplicaRefused, ReplicaLost,
grpc errors), with every request to a replica on one stream."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import pytest

from pagoda.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams
from pagoda.services._proto.pagoda.common.v1 import common_pb2 as cpb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services.gateway.routing.peers import ReplicaLost, ReplicaRefused, SchedulerReplica


class MuxReplica(spb_grpc.SchedulerServiceServicer):
    """`GenerateStream` by script: every 5 ms one batch with one token (its index) for
    each live request (in the token columns; the last one as an item), then its
    `complete` after `max_tokens`. A request id starting
    with "bad" gets an INVALID_ARGUMENT error item; `kill_after` batches the stream ends
    UNAVAILABLE (a replica that died). Records the streams opened and the aborts read."""

    def __init__(self, kill_after: int | None = None) -> None:
        self.kill_after = kill_after
        self.streams = 0
        self.aborts: list[str] = []
        self.batches: list[spb.GenerateStreamBatch] = []

    def GenerateStream(self, request_iterator, context):
        self.streams += 1
        context.send_initial_metadata(())
        inbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(request_iterator, inbox), daemon=True).start()
        live: dict[str, list] = {}  # id -> [tokens sent, max_tokens]
        sent = 0
        while context.is_active():
            items = []
            while not inbox.empty():
                message = inbox.get()
                for request in message.requests:
                    if request.request_id.startswith("bad"):
                        items.append(spb.GenerateStreamItem(
                            request_id=request.request_id, error=spb.GenerateError(
                                code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                message="prompt too long")))
                    else:
                        live[request.request_id] = [0, request.sampling_params.max_tokens]
                for rid in message.abort_request_ids:
                    self.aborts.append(rid)
                    live.pop(rid, None)
            columns = spb.GenerateStreamBatch()
            for rid, state in list(live.items()):
                if state[0] + 1 < state[1]:  # a plain token: in the columns, as a replica does
                    columns.token_request_ids.append(rid)
                    columns.token_counts.append(1)
                    columns.token_ids.append(state[0])
                    columns.num_cached_tokens.append(0)
                    state[0] += 1
                    continue
                items.append(spb.GenerateStreamItem(request_id=rid, chunk=spb.GenerateChunk(
                    token_ids=[state[0]])))
                state[0] += 1
                if state[0] == state[1]:
                    items.append(spb.GenerateStreamItem(
                        request_id=rid,
                        complete=spb.GenerateComplete(finish_reason=cpb.FINISH_REASON_LENGTH)))
                    del live[rid]
            if items or columns.token_request_ids:
                if self.kill_after is not None and sent >= self.kill_after:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
                batch = columns
                batch.items.extend(items)
                self.batches.append(batch)
                sent += 1
                yield batch
            time.sleep(0.005)


    @staticmethod
    def _read(request_iterator, inbox: queue.Queue) -> None:
        try:
            for message in request_iterator:
                inbox.put(message)
        except grpc.RpcError:
            pass  # the stream ended


class OldReplica(spb_grpc.SchedulerServiceServicer):
    """A replica from before `GenerateStream`: `Generate` only (three tokens)."""

    def __init__(self) -> None:
        self.calls = 0

    def Generate(self, request, context):
        self.calls += 1
        yield spb.GenerateResponse(chunk=spb.GenerateChunk(token_ids=[7, 8, 9]))
        yield spb.GenerateResponse(complete=spb.GenerateComplete(
            finish_reason=cpb.FINISH_REASON_LENGTH))


def request(rid: str, max_tokens: int = 5) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens))


async def tokens_of(replica: SchedulerReplica, req: EngineCoreRequest) -> list[int]:
    tokens = []
    async for out in replica.generate(req):
        tokens.extend(out.new_token_ids)
        if out.finished:
            return tokens
    raise AssertionError("the outputs ended before the finished one")


def run(address: str, body):
    async def main():
        replica = SchedulerReplica(address)
        try:
            return await asyncio.wait_for(body(replica), 30)
        finally:
            replica.mux.close()
            await replica.channel.close()
    return asyncio.run(main())


@pytest.fixture
def serve(grpc_server_factory):
    def start(servicer) -> str:
        return grpc_server_factory(spb_grpc.add_SchedulerServiceServicer_to_server,
                                   servicer).address
    return start


def test_requests_share_one_stream_and_each_gets_its_own_outputs(serve):
    replica = MuxReplica()
    address = serve(replica)

    async def body(r):
        results = await asyncio.gather(*(tokens_of(r, request(f"r{i}", 3 + i))
                                         for i in range(4)))
        results.append(await tokens_of(r, request("later", 2)))  # the same stream again
        return results

    results = run(address, body)
    assert results == [list(range(3 + i)) for i in range(4)] + [[0, 1]]
    assert replica.streams == 1
    assert max(len({i.request_id for i in b.items} | set(b.token_request_ids))
               for b in replica.batches) == 4


def test_closing_one_request_aborts_it_alone(serve):
    replica = MuxReplica()
    address = serve(replica)

    async def body(r):
        async def leave_early():
            stream = r.generate(request("leaver", 100))
            async for out in stream:
                break  # the client went away after its first token
            await stream.aclose()
        others = [tokens_of(r, request(f"stay{i}", 20)) for i in range(2)]
        results = await asyncio.gather(leave_early(), *others)
        return results[1:]

    assert run(address, body) == [list(range(20))] * 2
    assert replica.aborts == ["leaver"]


def test_a_request_failed_by_the_replica_fails_alone_with_its_status(serve):
    address = serve(MuxReplica())

    async def body(r):
        good = asyncio.ensure_future(tokens_of(r, request("good", 10)))
        with pytest.raises(grpc.RpcError) as info:
            await tokens_of(r, request("bad-one"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "prompt too long"
        return await good

    assert run(address, body) == list(range(10))


def test_a_broken_stream_fails_every_request_as_a_broken_call_did(serve):
    address = serve(MuxReplica(kill_after=3))

    async def body(r):
        started = [r.generate(request(f"r{i}", 50)) for i in range(3)]
        outputs = [await s.__anext__() for s in started]  # each produced output
        assert all(o.new_token_ids for o in outputs)
        errors = []
        for s in started:
            with pytest.raises(ReplicaLost) as info:
                async for _ in s:
                    pass
            errors.append(info.value)
        # A request that had no output yet is refused (retryable elsewhere), not lost.
        fresh = await r.mux.outputs(request("fresh")).__anext__()  # a new stream opens
        return errors, fresh

    errors, fresh = run(address, body)
    assert [e.status for e in errors] == [503] * 3
    assert all(e.reason == "replica_lost" for e in errors)
    assert fresh.new_token_ids == [0]


def test_a_request_refused_before_output_by_a_broken_stream_is_retryable(serve):
    address = serve(MuxReplica(kill_after=0))  # dies at its first batch

    async def body(r):
        with pytest.raises(ReplicaRefused) as info:
            await tokens_of(r, request("first"))
        return info.value

    refused = run(address, body)
    assert refused.code == grpc.StatusCode.UNAVAILABLE and refused.status == 503


def test_a_replica_without_the_stream_gets_generate_calls(serve):
    old = OldReplica()
    address = serve(old)

    async def body(r):
        first = await tokens_of(r, request("a"))
        supported = r.mux.supported
        second = await asyncio.gather(tokens_of(r, request("b")), tokens_of(r, request("c")))
        return first, supported, second

    first, supported, second = run(address, body)
    assert first == [7, 8, 9] and second == [[7, 8, 9]] * 2
    assert supported is False and old.calls == 3
