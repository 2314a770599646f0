"""One completion (one OpenAI choice) end to end: scheduler stream -> decode -> text deltas.

Token ids come from the scheduler; text comes from the tokenizer's DecodeStream,
which also matches stop strings. When a stop string ends the text, the request is
aborted in the scheduler (closing the stream cancels the call) and the tokens
after the one that completed the match are dropped, so usage counts only the
tokens the client's text came from (and so do their logprobs).

The text of the token that ended the request (EOS or a stop token id) is left out
unless include_stop_str_in_output, as offline (vLLM's rule), so the decoder must
learn that a token ended the request together with that token; see
`_finish_with_last_tokens`.

Logprob candidates ride the same decode round trip: each input names the ids
whose text the logprobs need (`decode_token_ids`), so asking for logprobs costs
no extra call.

A replica that goes away mid-stream does not end the choice: its outputs continue
from another replica (`_migrating_outputs`, migration.py) while the decoder stays
the same, so the client's stream, stop strings and text carry on unbroken.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

import grpc

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagoda.services.common.protocol.sampling_params import decode_options_to_proto
from pagoda.services.gateway.errors import APIError, from_grpc_error
from pagoda.services.gateway.generation.decode_mux import DecodeMux, DecodeStreamBroken
from pagoda.services.gateway.generation.decode_resume import ResumableDecode
from pagoda.services.gateway.generation.migration import ChoiceRoute, Migration, enders
from pagoda.services.gateway.openai.logprobs import TokenLogprob, candidate_ids, token_logprobs
from pagoda.services.gateway.routing.peers import ReplicaLost, ReplicaRefused, SchedulerReplica

logger = logging.getLogger(__name__)


@dataclass
class ChoiceDelta:
    """New text of one choice; `finish_reason` set on its last delta.

    `logprobs` (when the request asked for them) is parallel to `token_ids`;
    `prompt_logprobs` (when asked) is the whole prompt's, on the choice's first delta.
    """

    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


class _LogprobRows:
    """A choice's logprobs as they arrive: which ids to decode, then the rows."""

    def __init__(self, request: EngineCoreRequest, discard_output: bool) -> None:
        params = request.sampling_params
        self.want_output = params.logprobs is not None
        self.discard_output = discard_output
        self.prompt_ids = request.prompt_token_ids
        self.prompt: list[TokenLogprob] | None = [] if params.prompt_logprobs is not None \
            else None
        self._prompt_taken = False
        self.wanted = self.prompt is not None or self.want_output  # else `read` gives None

    def ids_to_decode(self, out: EngineCoreOutput, first: bool) -> list[int]:
        ids = []
        if self.prompt is not None:
            if first:  # the first prompt token has no logprob, but echo shows its text
                ids.append(self.prompt_ids[0])
            ids += candidate_ids(out.new_prompt_logprobs)
        if self.want_output and not self.discard_output:
            ids += candidate_ids(out.new_logprobs)
        return ids

    def read(self, out: EngineCoreOutput, first: bool, texts) -> list[TokenLogprob] | None:
        """Consume the decoded texts (in `ids_to_decode` order); the output rows."""
        texts = iter(texts)
        if self.prompt is not None:
            if first:
                self.prompt.append(TokenLogprob(self.prompt_ids[0], next(texts, "")))
            rows = token_logprobs(out.new_prompt_logprobs, texts)
            # A preempted request recomputes its prompt: keep one row per position.
            self.prompt.extend(rows[:len(self.prompt_ids) - len(self.prompt)])
        if not self.want_output:
            return None
        return [] if self.discard_output else token_logprobs(out.new_logprobs, texts)

    def take_prompt(self) -> list[TokenLogprob] | None:
        """The prompt's logprobs, once: on the first delta that goes out (the prefill
        that yields the first token has scored the whole prompt)."""
        if self.prompt is None or self._prompt_taken:
            return None
        self._prompt_taken = True
        return self.prompt


async def stream_choice(replica: SchedulerReplica, mux: DecodeMux, request: EngineCoreRequest,
                        index: int, discard_output: bool = False,
                        migration: Migration | None = None) -> AsyncIterator[ChoiceDelta]:
    """Yield the choice's deltas; the last one has a finish_reason. Raises APIError.

    `discard_output`: the caller wants only the prompt's logprobs (completions'
    echo with max_tokens 0): the generated token is neither decoded nor shown.
    `migration`: the request's (migration.py); None: a lost replica ends the choice.
    """
    rid = request.request_id
    options = decode_options_to_proto(request.prompt_token_ids, request.sampling_params)
    rows = _LogprobRows(request, discard_output)
    decoding = ResumableDecode(mux, options)  # a dead tokenizer's stream resumes elsewhere
    outputs = _finish_with_last_tokens(
        _migrating_outputs(replica, ChoiceRoute(request), migration), request)
    first, complete = True, False
    try:
        async for out in outputs:
            token_ids = [] if discard_output else out.new_token_ids
            item = tpb.DecodeInput(request_id=rid, token_ids=token_ids)
            # Set only what is not the default: fewer fields, a cheaper message per token.
            if out.finish_reason is not None:
                item.finished = True
                item.stop_terminated = out.finish_reason == FinishReason.STOP
            if rows.wanted and (decode_ids := rows.ids_to_decode(out, first)):
                item.decode_token_ids.extend(decode_ids)
            if first:
                item.options.CopyFrom(options)
            was_first, first = first, False
            result = await decoding.decode(item, token_ids)
            logprobs = rows.read(out, was_first, result.decoded_tokens) if rows.wanted \
                else None  # (per token: no message field read for nothing)
            if migration is not None:
                migration.started = True
            if result.HasField("chunk"):
                text = result.chunk.text  # each read of a message's string makes a new str
                if token_ids or text:  # not a prompt-logprobs-only message
                    decoding.shown(text)
                    yield ChoiceDelta(index, text, token_ids,
                                      num_cached_tokens=out.num_cached_tokens,
                                      logprobs=logprobs, prompt_logprobs=rows.take_prompt())
                continue
            complete = True
            done = result.complete
            used = done.num_tokens_used
            finish = ("stop", done.stop_string) if done.stop_string else \
                (str(out.finish_reason), out.stop_reason)
            yield ChoiceDelta(index, done.text, token_ids[:used], *finish, out.num_cached_tokens,
                              logprobs[:used] if logprobs is not None else None,
                              rows.take_prompt())
            return
        raise APIError("The scheduler ended the request without finishing it.", 500)
    except grpc.RpcError as exc:
        raise from_grpc_error(exc, "scheduler") from None
    except DecodeStreamBroken as exc:
        logger.warning("request %s: the decode stream broke: %s", rid, exc)
        raise APIError("The tokenizer stopped decoding the answer; retry later.", 503) from None
    finally:
        await outputs.aclose()  # cancels the call: the scheduler aborts the request
        if not complete and not first:
            mux.release(rid)


async def _migrating_outputs(replica: SchedulerReplica, choice: ChoiceRoute,
                             migration: Migration | None) -> AsyncIterator[EngineCoreOutput]:
    """The choice's outputs from `replica` and, when a replica goes away before the
    choice finished, from the next one (migration.py). Each output is yielded once;
    `choice.generated` holds every token id yielded so far."""
    route = None
    try:
        while True:
            stream = replica.generate(choice.next_request())
            try:
                async for out in stream:
                    choice.generated.extend(out.new_token_ids)
                    yield out
                    if out.finished:
                        return
                error = ReplicaLost("The model replica ended the request without finishing "
                                    "it.", replica.address)
            except ReplicaRefused as error_:
                if migration is None or not (choice.generated or migration.started):
                    raise  # nothing streamed yet: routing/dispatch.py retries the whole request
                error = error_
            except ReplicaLost as error_:
                if migration is None:
                    raise
                error = error_
            finally:
                await stream.aclose()
            end = choice.finish_without_replica()
            if end is not None:
                yield end
                return
            if migration is None:
                raise error
            next_route = await migration.reroute(choice, replica, error)
            if route is not None:
                route.release()
            route, replica = next_route, next_route.replica
    finally:
        if route is not None:
            route.release()


async def _finish_with_last_tokens(outputs: AsyncIterator[EngineCoreOutput],
                                   request: EngineCoreRequest
                                   ) -> AsyncIterator[EngineCoreOutput]:
    """`outputs`, with a finishing step's tokens and its finish reason in one output.

    The scheduler sends them as two messages, a chunk and then a tokenless
    `complete`. A chunk whose last token can end the request (a stop token id, or
    EOS unless ignore_eos) is held until the next message and merged with it if
    that is the `complete`. Such a token is only sampled when it does end the
    request (the sampler masks them before min_tokens), and the `complete` is sent
    right behind its chunk, so holding it delays nothing in practice; if it did
    not end the request, the chunk goes out unchanged with the next message.
    """
    ending_ids = enders(request)
    held: EngineCoreOutput | None = None
    try:
        async for out in outputs:
            if held is not None:
                if out.finished and not out.new_token_ids and out.new_logprobs is None \
                        and out.new_prompt_logprobs is None:
                    yield replace(held, finish_reason=out.finish_reason,
                                  stop_reason=out.stop_reason,
                                  num_cached_tokens=out.num_cached_tokens)
                    held = None
                    continue
                yield held
                held = None
            if out.new_token_ids and not out.finished and out.new_token_ids[-1] in ending_ids:
                held = out
            else:
                yield out
        if held is not None:
            yield held
    finally:
        await outputs.aclose()


def merge_choices(streams: Sequence[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    """Interleave several choices' deltas as they come; the first error wins and
    cancels the others. One stream is returned as it is (no generator in between:
    every token of a stream passes each layer)."""
    if len(streams) == 1:
        return streams[0]
    return _merged(streams)


async def _merged(streams: Sequence[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[ChoiceDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put(delta)
            await queue.put(done)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the consumer)
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
