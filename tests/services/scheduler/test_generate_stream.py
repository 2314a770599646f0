"""The scheduler's `GenerateStream`: many requests over one stream (generate_mux.py).

Over a real scheduler servicer and gpu-worker (tiny random Llama, CPU): the requests of
one stream get exactly the offline engine's tokens, one batch carries several of them;
aborting one, or one failing its checks, touches nothing else on the stream; the stream
ending aborts every request on it and gives their KV blocks back.
"""

from __future__ import annotations

import itertools
import queue
import threading

import grpc
import pytest

from pagoda.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services.common.protocol.scheduler import request_to_proto, response_to_output

from test_scheduler_service import (PROMPTS, SchedulerHarness, engine_config, offline_tokens,
                                    requests, start_worker)


@pytest.fixture
def scheduler(tiny_llama_dir):
    address, worker = start_worker(engine_config(tiny_llama_dir))
    harness = SchedulerHarness(engine_config(tiny_llama_dir), address)
    yield harness
    harness.close()
    worker.stop(None)


class StreamClient:
    """One `GenerateStream` call: `send` messages, read `batches`."""

    def __init__(self, stub) -> None:
        self._outbox: queue.Queue = queue.Queue()
        self.call = stub.GenerateStream(iter(self._outbox.get, None), timeout=60)

    def send(self, requests=(), aborts=()) -> None:
        self._outbox.put(spb.GenerateStreamRequest(
            requests=[r if isinstance(r, spb.GenerateRequest) else request_to_proto(r)
                      for r in requests], abort_request_ids=list(aborts)))

    def collect(self, expected: set[str], read=()):
        """Read until every id in `expected` ended: ({id: tokens}, {id: end item}, batches);
        `read`: batches already read."""
        tokens: dict[str, list[int]] = {}
        ends: dict[str, spb.GenerateStreamItem] = {}
        batches = []
        for batch in itertools.chain(read, self.call):
            batches.append(batch)
            start = 0
            for rid, count in zip(batch.token_request_ids, batch.token_counts):
                tokens.setdefault(rid, []).extend(batch.token_ids[start:start + count])
                start += count
            assert start == len(batch.token_ids)
            for item in batch.items:
                if item.HasField("chunk"):
                    tokens.setdefault(item.request_id, []).extend(item.chunk.token_ids)
                else:
                    ends[item.request_id] = item
            if expected <= set(ends):
                return tokens, ends, batches
        raise AssertionError(f"the stream ended; ends: {sorted(ends)}")


def spy_aborts(scheduler) -> list[str]:
    """The ids the servicer aborts in the engine from now on."""
    aborted: list[str] = []
    abort = scheduler.engine.abort
    scheduler.engine.abort = lambda ids: (aborted.extend(ids), abort(ids))
    return aborted


def _wait_idle(scheduler) -> bool:
    """Whether the engine runs nothing and every KV block is free (within ~5 s)."""
    for _ in range(100):
        stats = scheduler.engine.stats
        if (stats.num_running == 0 and stats.num_waiting == 0
                and stats.num_free_blocks == stats.num_blocks):
            return True
        threading.Event().wait(0.05)
    return False


def test_one_stream_gives_every_request_the_offline_tokens_in_shared_batches(
        tiny_llama_dir, scheduler):
    expected = offline_tokens(tiny_llama_dir)
    client = StreamClient(scheduler.stub)
    client.send(requests())
    tokens, ends, batches = client.collect({r.request_id for r in requests()})
    assert tokens == expected
    for rid, item in ends.items():
        assert item.HasField("complete"), item
        assert response_to_output(rid, item).finish_reason is not None
    # A step's outputs of every request travel together, not one message per request.
    assert max(len({i.request_id for i in b.items} | set(b.token_request_ids))
               for b in batches) == len(PROMPTS)
    # A request is in a batch's items or in its token columns, never both.
    assert all(not ({i.request_id for i in b.items} & set(b.token_request_ids))
               for b in batches)
    client.call.cancel()


def test_aborting_one_request_frees_it_and_leaves_the_others_running(scheduler):
    aborted = spy_aborts(scheduler)
    client = StreamClient(scheduler.stub)
    long = EngineCoreRequest("long", PROMPTS[2], SamplingParams(max_tokens=200, ignore_eos=True))
    others = requests(max_tokens=30)[:2]
    client.send([long, *others])
    first = next(iter(client.call))  # running
    assert first.items or first.token_request_ids
    client.send(aborts=["long"])
    tokens, ends, _ = client.collect({r.request_id for r in others}, read=[first])
    assert all(len(tokens[r.request_id]) == 30 for r in others)
    assert "long" not in ends  # an aborted request gets no end: its caller left
    assert len(tokens.get("long", [])) < 200
    assert aborted == ["long"]  # it alone was aborted in the engine ...
    assert _wait_idle(scheduler)  # ... and its blocks went back
    client.call.cancel()


def test_a_bad_request_fails_alone_and_the_stream_serves_on(scheduler):
    client = StreamClient(scheduler.stub)
    good = requests(max_tokens=5)[0]
    too_long = EngineCoreRequest("too-long", list(range(300)), SamplingParams(max_tokens=4))
    empty = spb.GenerateRequest(request_id="empty", sampling_params=request_to_proto(
        good).sampling_params)
    client.send([too_long, good, empty, good])  # `good` twice: the second is refused
    tokens, ends, _ = client.collect({"too-long", "empty", good.request_id})
    assert ends["too-long"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "maximum model length" in ends["too-long"].error.message
    assert ends["empty"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # The duplicate's refusal may come before or after the first one's end.
    if ends[good.request_id].HasField("error"):
        assert ends[good.request_id].error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
        tokens, ends, _ = client.collect({good.request_id})
    assert ends[good.request_id].HasField("complete")
    assert len(tokens[good.request_id]) == 5
    # ... and takes new requests afterwards.
    later = requests(max_tokens=3)[1]
    client.send([later])
    tokens, ends, _ = client.collect({later.request_id})
    assert len(tokens[later.request_id]) == 3 and ends[later.request_id].HasField("complete")
    client.call.cancel()


def test_the_stream_ending_aborts_every_request_on_it(scheduler):
    aborted = spy_aborts(scheduler)
    client = StreamClient(scheduler.stub)
    client.send([EngineCoreRequest(f"gone{i}", p, SamplingParams(max_tokens=200,
                                                                   ignore_eos=True))
                 for i, p in enumerate(PROMPTS)])
    next(iter(client.call))  # they run
    assert scheduler.engine.stats.num_running + scheduler.engine.stats.num_waiting > 0
    client.call.cancel()  # the gateway went away
    assert _wait_idle(scheduler)
    assert sorted(aborted) == [f"gone{i}" for i in range(len(PROMPTS))]
    assert scheduler.servicer.num_in_flight == 0
