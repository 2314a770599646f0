"""The replica's side of `GenerateStream`: many requests over one stream per caller.

    gateway ──GenerateStreamRequest(requests, abort ids)──►  reader task: admit / abort
    gateway ◄──GenerateStreamBatch(one per write)─────────  writer (the handler itself)

The engine thread hands every step's outputs to the event loop once (servicer
`_dispatch`). A decode step's plain output (tokens only, not the end) of a request with
nothing pending goes straight into its connection's token columns; any other output
lands on its request's pending list, and a request with something pending is marked
dirty on its connection. The writer drains the columns and all dirty requests into ONE
batch per wake-up, so a step costs one message per connection instead of one per
request (and no per-request work on the loop beyond the append), and outputs that
pile up while a write is blocked (the caller reads slower than the steps) coalesce per
request, as on `Generate`. A request's column entry always holds outputs older than
its pending ones, and columns are read before items, so its order holds.

Invariants:
  * a request is in `requests` from the moment it is read until its end went into a
    batch (complete or error) or it was aborted; whatever is in `requests` when the
    stream ends (the caller went away, or the stream broke) is aborted in the engine;
  * a request's failure (bad input, a refusal, the worker failing it) is an `error`
    item for that request only: the stream and the other requests go on;
  * each request's items are what its `Generate` stream would carry
    (`outputs_to_items` = `outputs_to_responses`; a decode step's plain tokens go in the
    batch's token columns instead: the same chunk without a message per request), its
    error the status it would end with.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pagoda.messages import EngineCoreOutput
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as pb
from pagoda.services.common.protocol.scheduler import outputs_to_items

logger = logging.getLogger(__name__)
# A stream's error `reason` for a request that failed through its own fault (not a
# migration reason: nothing to move).
INVALID = "invalid_request"


class MuxRequest:
    """One request of a `GenerateStream`: the servicer's stream object for it (it
    `deliver`s outputs and `fail`s it like a `Generate` stream's)."""

    __slots__ = ("request_id", "connection", "pending", "error", "dirty", "accepted", "closed",
                 "round")

    def __init__(self, request_id: str, connection: "MuxConnection") -> None:
        self.request_id = request_id
        self.connection = connection
        self.pending: list[EngineCoreOutput] = []
        self.error: tuple[str, str | None, bool] | None = None
        self.dirty = False  # in connection.dirty
        self.accepted = False  # the engine took it: release() is ours to call
        self.closed = False  # ended on the stream (its end sent, aborted, or the stream gone)
        self.round = -1  # the connection's `round` in which it last got a column entry

    def deliver(self, output: EngineCoreOutput) -> None:
        if (not self.pending and output.finish_reason is None and output.new_token_ids
                and output.new_logprobs is None and output.new_prompt_logprobs is None
                and self.error is None and not self.closed):
            # Plain tokens: the connection's columns, as `_collect` would put them.
            connection = self.connection
            if self.round == connection.round:
                connection.repeats += 1  # a second entry this batch: merged in _collect
            else:
                self.round = connection.round
            connection.token_requests.append(self)
            connection.token_counts.append(len(output.new_token_ids))
            connection.token_ids.extend(output.new_token_ids)
            connection.num_cached_tokens.append(output.num_cached_tokens)
            if len(connection.token_requests) == 1:
                connection.ready.set()
            return
        self.pending.append(output)
        if not self.dirty:
            self.dirty = True
            self.connection.dirty.append(self)
            self.connection.ready.set()

    def fail(self, error: tuple[str, str | None, bool]) -> None:
        self.error = error
        if not self.dirty:
            self.dirty = True
            self.connection.dirty.append(self)
            self.connection.ready.set()


def dispatch(streams: dict, outputs: list[EngineCoreOutput]) -> None:
    """Each output to its request's stream (`streams`: id -> a stream object with
    `deliver`), as `streams[id].deliver(output)` for each would, with `MuxRequest.deliver`'s
    plain-token case inline: a decode step brings one such output per running request
    (256 a step at batch 256), and this runs on the event loop every step."""
    get = streams.get
    connection = None
    for output in outputs:
        stream = get(output.request_id)
        if stream is None:
            continue  # the handler already left (aborted)
        if (type(stream) is not MuxRequest or stream.pending or output.finish_reason is not None
                or not output.new_token_ids or output.new_logprobs is not None
                or output.new_prompt_logprobs is not None or stream.error is not None
                or stream.closed):
            stream.deliver(output)
            continue
        if stream.connection is not connection:
            connection = stream.connection
            token_requests, token_counts = connection.token_requests, connection.token_counts
            token_ids, num_cached = connection.token_ids, connection.num_cached_tokens
            this_round = connection.round
        if stream.round == this_round:
            connection.repeats += 1  # a second entry this batch: merged in _collect
        else:
            stream.round = this_round
        token_requests.append(stream)
        token_counts.append(len(output.new_token_ids))
        token_ids.extend(output.new_token_ids)
        num_cached.append(output.num_cached_tokens)
        if len(token_requests) == 1:
            connection.ready.set()


class MuxConnection:
    """One `GenerateStream` call. `run()` is the handler's body: it yields the batches."""

    def __init__(self, servicer, request_iterator) -> None:
        self.servicer = servicer
        self._incoming = request_iterator
        self.requests: dict[str, MuxRequest] = {}
        self.dirty: list[MuxRequest] = []
        self.refused: list[pb.GenerateStreamItem] = []  # errors of requests never accepted
        # The next batch's token columns, filled by `MuxRequest.deliver` (the requests
        # themselves, not their ids: an id may come back on a new request); `round`
        # counts the batches collected, `repeats` the requests with a second entry this
        # round or one ended on the stream after its entry.
        self.token_requests: list[MuxRequest] = []
        self.token_counts: list[int] = []
        self.token_ids: list[int] = []
        self.num_cached_tokens: list[int] = []
        self.round = 0
        self.repeats = 0
        self.ready = asyncio.Event()
        self._admissions: set[asyncio.Task] = set()
        self._reader: asyncio.Task | None = None

    async def run(self):
        self._reader = asyncio.get_running_loop().create_task(self._read())
        self._reader.add_done_callback(lambda _: self.ready.set())
        sent: list[MuxRequest] = []  # finished requests whose end is in the batch being written
        try:
            while True:
                await self.ready.wait()
                self.ready.clear()
                batch = self._collect(sent)
                if batch is not None:
                    yield batch
                for request in sent:  # the last output (naming a lease) went out
                    self.servicer.release(request.request_id, finished=True, delivered=True)
                sent.clear()
                if self._reader.done() and (self._reader.cancelled()
                                            or self._reader.exception() is not None
                                            or not (self.requests or self.refused)):
                    return  # the input broke, or ended with nothing left to answer
        finally:
            self._reader.cancel()
            for task in list(self._admissions):
                task.cancel()  # accept() aborts what it submitted
            for request in sent:
                self.servicer.release(request.request_id, finished=True, delivered=False)
            if self.requests:
                logger.info("a generate stream ended with %d requests in flight: aborting them",
                            len(self.requests))
            for request in list(self.requests.values()):
                self._end(request)

    def _collect(self, sent: list[MuxRequest]) -> pb.GenerateStreamBatch | None:
        """Every dirty request's output (and the refusals) as the next batch, None when
        there is nothing to send; requests whose end goes out are taken off the stream
        (`sent`: the finished ones)."""
        items, self.refused = self.refused, []
        dirty, self.dirty = self.dirty, []
        requests = self.requests
        entries, self.token_requests = self.token_requests, []
        counts, self.token_counts = self.token_counts, []
        tokens, self.token_ids = self.token_ids, []
        cached, self.num_cached_tokens = self.num_cached_tokens, []
        this_round = self.round
        self.round += 1
        repeats, self.repeats = self.repeats, 0
        # Rare (the writer was blocked for several steps, or a request ended on the
        # stream since its entry): a request with two column entries, with one and
        # something pending, or closed. Its entries are joined into one, put back before
        # its pending outputs, or dropped, so the batch is what it would have been had
        # every output gone to the pending list.
        behind = [r for r in dirty if r.round == this_round]
        if repeats or behind:
            joined = _join_columns(entries, counts, tokens, cached)
            for request in behind:
                ids, num_cached = joined.pop(request)
                request.pending[:0] = [EngineCoreOutput(request.request_id, ids,
                                                        num_cached_tokens=num_cached)]
            for request in [r for r in joined if r.closed]:
                del joined[request]
            entries = list(joined)
            counts = [len(ids) for ids, _ in joined.values()]
            tokens = [t for ids, _ in joined.values() for t in ids]
            cached = [num_cached for _, num_cached in joined.values()]
        rids = [request.request_id for request in entries]
        for request in dirty:
            request.dirty = False
            if request.closed:
                continue
            rid = request.request_id
            if request.error is not None:
                items.append(_error_item(rid, *error_status(request.error)))
                self._end(request, finished=not request.error[2])
                continue
            batch, request.pending = request.pending, []
            if not batch:
                continue
            last = batch[-1]
            if last.finish_reason is None:
                # Decode steps' tokens, nothing else (every request, every step): columns.
                # Several steps' (the writer was blocked while they came) make one entry,
                # the chunk `outputs_to_items` would coalesce them into.
                if len(batch) == 1:
                    if (last.new_token_ids and last.new_logprobs is None
                            and last.new_prompt_logprobs is None):
                        rids.append(rid)
                        counts.append(len(last.new_token_ids))
                        tokens.extend(last.new_token_ids)
                        cached.append(last.num_cached_tokens)
                        continue
                elif _plain_tokens(batch):
                    start = len(tokens)
                    for out in batch:
                        tokens.extend(out.new_token_ids)
                    if len(tokens) > start:
                        rids.append(rid)
                        counts.append(len(tokens) - start)
                        cached.append(last.num_cached_tokens)
                        continue
            outputs_to_items(rid, batch, items)
            if last.finished:
                del requests[rid]
                request.closed = True
                sent.append(request)
        if not (items or rids):
            return None
        return pb.GenerateStreamBatch(items=items, token_request_ids=rids, token_counts=counts,
                                      token_ids=tokens, num_cached_tokens=cached)

    def _end(self, request: MuxRequest, finished: bool = False) -> None:
        """Take `request` off the stream; the engine aborts it unless it `finished` there."""
        if self.requests.get(request.request_id) is request:
            del self.requests[request.request_id]
        if request.closed:
            return
        request.closed = True
        if request.round == self.round:  # its column entry must not go out
            self.repeats += 1
        if request.accepted:
            self.servicer.release(request.request_id, finished=finished, delivered=False)
        # else: its admission is under way and releases it when it returns

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        async for message in self._incoming:
            for request in message.requests:
                rid = request.request_id
                if rid in self.requests:  # the servicer would say so too, but ours is in the way
                    self._refuse(rid, grpc.StatusCode.ALREADY_EXISTS,
                                 f"request id {rid!r} is in use")
                    continue
                # On the stream before its admission runs: an abort in the same message
                # (or the stream ending) finds it.
                entry = self.requests[rid] = MuxRequest(rid, self)
                task = loop.create_task(self._admit(request, entry))
                self._admissions.add(task)
                task.add_done_callback(self._admissions.discard)
            for rid in message.abort_request_ids:
                entry = self.requests.get(rid)
                if entry is not None:
                    self._end(entry)

    async def _admit(self, message: pb.GenerateRequest, request: MuxRequest) -> None:
        rid = request.request_id
        try:
            refusal = await self.servicer.accept(message, request, traced=False)
        except Exception as exc:  # noqa: BLE001 - one request's failure, never the stream's
            logger.exception("request %s failed on admission", rid)
            refusal = grpc.StatusCode.INTERNAL, f"The replica could not admit the request: {exc}"
        if refusal is not None:
            if not request.closed:
                self._end(request)
                self._refuse(rid, *refusal)
            return
        request.accepted = True
        if request.closed:  # aborted (or the stream failed it) while it was being admitted
            self.servicer.release(rid, finished=False, delivered=False)

    def _refuse(self, rid: str, code: grpc.StatusCode, message: str) -> None:
        self.refused.append(_error_item(rid, code, message, None))
        self.ready.set()


def _join_columns(entries: list[MuxRequest], counts: list[int], tokens: list[int],
                  cached: list[int]) -> dict[MuxRequest, tuple[list[int], int]]:
    """Token columns as request -> (its tokens, in order, and the num_cached_tokens of
    its last entry): each request's entries joined into the chunk they coalesce into."""
    joined: dict[MuxRequest, tuple[list[int], int]] = {}
    start = 0
    for request, count, num_cached in zip(entries, counts, cached):
        entry = joined.get(request)
        ids = entry[0] if entry is not None else []
        ids.extend(tokens[start:start + count])
        joined[request] = ids, num_cached
        start += count
    return joined


def _plain_tokens(outputs: list[EngineCoreOutput]) -> bool:
    """Whether the outputs carry tokens only (no logprobs): what token columns hold."""
    for out in outputs:
        if out.new_logprobs is not None or out.new_prompt_logprobs is not None:
            return False
    return True


def error_status(error: tuple[str, str | None, bool]) -> tuple[grpc.StatusCode, str, str | None]:
    """A `_RequestStream.error` as the status that ends the request's stream: (code,
    details, migration reason or None)."""
    message, reason, _ = error
    if reason is None:  # this request's own failure: nowhere to move it
        return grpc.StatusCode.INTERNAL, message, None
    if reason is INVALID:  # ... caused by the request itself
        return grpc.StatusCode.INVALID_ARGUMENT, message, None
    return grpc.StatusCode.UNAVAILABLE, message, reason



def _error_item(rid: str, code: grpc.StatusCode, message: str, reason: str | None
                ) -> pb.GenerateStreamItem:
    return pb.GenerateStreamItem(request_id=rid, error=pb.GenerateError(
        code=code.value[0], message=message, migration_reason=reason or ""))
