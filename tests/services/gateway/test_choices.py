"""The gateway hands the decoder a finishing step's tokens together with its finish reason,
so the text of a stop token or EOS follows vLLM's rule (tests/e2e/test_cluster_stop_strings.py
checks the text end to end)."""

from __future__ import annotations

import asyncio

from pagoda.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagoda.sampling_params import SamplingParams
from pagoda.services.gateway.generation.choices import _finish_with_last_tokens

EOS, STOP_ID = 2, 7


def regrouped(outputs: list[EngineCoreOutput], **params) -> list[EngineCoreOutput]:
    request = EngineCoreRequest("r", [1], SamplingParams(**params), eos_token_ids=[EOS])
    closed = []

    async def stream():
        try:
            for out in outputs:
                yield out
        finally:
            closed.append(True)

    async def run():
        return [out async for out in _finish_with_last_tokens(stream(), request)]

    result = asyncio.run(run())
    assert closed == [True]  # the scheduler stream is always closed
    return result


def chunk(*ids: int) -> EngineCoreOutput:
    return EngineCoreOutput("r", list(ids), num_cached_tokens=3)


def complete(reason: FinishReason, stop_reason=None) -> EngineCoreOutput:
    return EngineCoreOutput("r", [], finish_reason=reason, stop_reason=stop_reason,
                            num_cached_tokens=3)


def test_a_stop_token_arrives_with_its_finish_reason():
    out = regrouped([chunk(5), chunk(6, STOP_ID), complete(FinishReason.STOP, STOP_ID)],
                    stop_token_ids=[STOP_ID])
    assert out == [chunk(5), EngineCoreOutput("r", [6, STOP_ID], finish_reason=FinishReason.STOP,
                                              stop_reason=STOP_ID, num_cached_tokens=3)]


def test_eos_is_merged_unless_ignore_eos():
    stream = [chunk(5, EOS), complete(FinishReason.STOP)]
    assert [(o.new_token_ids, o.finish_reason) for o in regrouped(stream)] == \
        [([5, EOS], FinishReason.STOP)]
    assert regrouped(stream, ignore_eos=True) == stream


def test_a_held_chunk_that_did_not_end_the_request_goes_out_unchanged():
    stream = [chunk(STOP_ID), chunk(8), complete(FinishReason.LENGTH)]
    assert regrouped(stream, stop_token_ids=[STOP_ID]) == stream
    assert regrouped([chunk(STOP_ID)], stop_token_ids=[STOP_ID]) == [chunk(STOP_ID)]
