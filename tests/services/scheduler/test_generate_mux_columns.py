"""`MuxConnection._collect`: a request's plain tokens go in the batch's token columns,
also when several steps' piled up while the writer was blocked (one entry, the chunk
`outputs_to_items` would make); anything else goes in its items."""

from __future__ import annotations

import asyncio

from pagoda.messages import EngineCoreOutput, FinishReason, LogprobsLists
from pagoda.services.scheduler.generate_mux import MuxConnection, MuxRequest, dispatch


class _Servicer:
    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, request_id, finished, delivered) -> None:
        self.released.append(request_id)


def _connection(*rids: str) -> tuple[MuxConnection, dict[str, MuxRequest]]:
    async def make():
        conn = MuxConnection(_Servicer(), None)
        for rid in rids:
            conn.requests[rid] = MuxRequest(rid, conn)
        return conn
    conn = asyncio.run(make())
    return conn, conn.requests


def _columns(batch) -> dict[str, tuple[list[int], int]]:
    out, start = {}, 0
    for rid, count, cached in zip(batch.token_request_ids, batch.token_counts,
                                  batch.num_cached_tokens):
        out[rid] = (list(batch.token_ids[start:start + count]), cached)
        start += count
    return out


def test_several_steps_of_plain_tokens_make_one_column_entry():
    conn, reqs = _connection("a", "b", "c")
    reqs["a"].deliver(EngineCoreOutput("a", [1], num_cached_tokens=2))
    reqs["a"].deliver(EngineCoreOutput("a", [2, 3], num_cached_tokens=5))
    reqs["b"].deliver(EngineCoreOutput("b", [4]))
    reqs["c"].deliver(EngineCoreOutput("c", []))  # a partial prefill's nothing, then tokens
    reqs["c"].deliver(EngineCoreOutput("c", [6], num_cached_tokens=1))
    batch = conn._collect([])
    assert _columns(batch) == {"a": ([1, 2, 3], 5), "b": ([4], 0), "c": ([6], 1)}
    assert not batch.items
    assert conn._collect([]) is None  # nothing pending any more


def test_logprobs_an_end_or_no_tokens_go_in_the_items():
    conn, reqs = _connection("lp", "end", "empty")
    reqs["lp"].deliver(EngineCoreOutput("lp", [1]))
    reqs["lp"].deliver(EngineCoreOutput("lp", [2], new_logprobs=LogprobsLists(
        [[2]], [[-0.5]], [[1]])))
    reqs["end"].deliver(EngineCoreOutput("end", [3]))
    reqs["end"].deliver(EngineCoreOutput("end", [4], finish_reason=FinishReason.LENGTH))
    reqs["empty"].deliver(EngineCoreOutput("empty", []))
    reqs["empty"].deliver(EngineCoreOutput("empty", []))
    sent: list[MuxRequest] = []
    batch = conn._collect(sent)
    assert not batch.token_request_ids
    chunks = {i.request_id: list(i.chunk.token_ids) for i in batch.items if i.HasField("chunk")}
    assert chunks == {"lp": [1, 2], "end": [3, 4]}
    assert [i.request_id for i in batch.items if i.HasField("complete")] == ["end"]
    assert [r.request_id for r in sent] == ["end"] and "end" not in conn.requests


def test_plain_tokens_go_straight_to_the_columns_and_wake_the_writer():
    conn, reqs = _connection("a", "b")
    reqs["a"].deliver(EngineCoreOutput("a", [7], num_cached_tokens=3))
    assert conn.ready.is_set() and not conn.dirty  # nothing pending: no per-request work left
    reqs["b"].deliver(EngineCoreOutput("b", [8, 9]))
    batch = conn._collect([])
    assert list(batch.token_request_ids) == ["a", "b"]
    assert _columns(batch) == {"a": ([7], 3), "b": ([8, 9], 0)}


def test_tokens_of_a_request_ended_on_the_stream_before_the_write_never_go_out():
    conn, reqs = _connection("gone", "kept")
    gone = reqs["gone"]
    gone.deliver(EngineCoreOutput("gone", [1]))
    reqs["kept"].deliver(EngineCoreOutput("kept", [2]))
    conn._end(gone)  # the gateway aborted it
    # Its id comes back on a new request, which gets tokens of its own in the same batch.
    again = conn.requests["gone"] = MuxRequest("gone", conn)
    again.deliver(EngineCoreOutput("gone", [3]))
    batch = conn._collect([])
    assert _columns(batch) == {"kept": ([2], 0), "gone": ([3], 0)}
    assert list(batch.token_request_ids).count("gone") == 1


def test_a_failed_request_sends_its_error_without_the_tokens_queued_before_it():
    conn, reqs = _connection("f")
    reqs["f"].deliver(EngineCoreOutput("f", [1]))
    reqs["f"].fail(("The model replica could not run this request.", None, False))
    batch = conn._collect([])
    assert not batch.token_request_ids
    assert [i.request_id for i in batch.items if i.HasField("error")] == ["f"]


def test_dispatch_is_deliver_per_output():
    """`dispatch` (the servicer's per-step hand-off, plain tokens inline) leaves every
    connection as `deliver` called per output would: the same batches, steps apart."""
    def outputs(step: int) -> list[EngineCoreOutput]:
        return [EngineCoreOutput("a", [step], num_cached_tokens=3),
                EngineCoreOutput("gone", [step]),  # a request whose handler left
                EngineCoreOutput("b", [10 + step], new_logprobs=LogprobsLists(
                    [[10 + step]], [[-0.5]], [[1]])) if step == 1 else
                EngineCoreOutput("b", [10 + step]),
                EngineCoreOutput("c", [20 + step],
                                 finish_reason=FinishReason.STOP if step == 2 else None),
                EngineCoreOutput("a", [30 + step])]  # a second entry in one hand-off

    batches = []
    for by_dispatch in (False, True):
        conn, reqs = _connection("a", "b", "c")
        other, other_reqs = _connection("d")  # a second stream's request in the same step
        streams = {**reqs, **other_reqs}
        seen = []
        for step in range(3):
            step_outputs = outputs(step) + [EngineCoreOutput("d", [40 + step])]
            if by_dispatch:
                dispatch(streams, step_outputs)
            else:
                for out in step_outputs:
                    if out.request_id in streams:
                        streams[out.request_id].deliver(out)
            assert conn.ready.is_set() and other.ready.is_set()
            conn.ready.clear()
            other.ready.clear()
            seen.append((conn._collect([]), other._collect([])))
        batches.append(seen)
    assert batches[0] == batches[1]
    assert _columns(batches[1][0][0]) == {"a": ([0, 30], 0), "b": ([10], 0), "c": ([20], 0)}
