"""The stream's per-token path writes the bytes the chunk dicts would give.

`ChunkRenderer.frames` splices pre-encoded parts (the header once per request, the
choice and the usage per chunk); each case feeds the same deltas to two renderers
and compares its bytes with json.dumps of `chunks`' dicts, over unicode (escaped
as json.dumps does), logprobs, echo, tool calls and reasoning, finish and stop
reasons, `n > 1` and continuous usage stats on and off.
"""

from __future__ import annotations

import json
import uuid

import pytest

from pagoda.reasoning import get_reasoning_parser
from pagoda.services.gateway.generation.choices import ChoiceDelta
from pagoda.services.gateway.openai.chat_output import ChatOutput
from pagoda.services.gateway.openai.completion_bodies import (LogprobsFormat, ResponseHeader,
                                                              Usage, compact_json, sse)
from pagoda.services.gateway.openai.completion_chunks import ChatChunks, CompletionChunks
from pagoda.services.gateway.openai.logprobs import Candidate, TokenLogprob
from pagoda.services.gateway.openai.tool_parsers import base as tool_base
from pagoda.services.gateway.openai.tool_parsers import get_tool_parser

TEXTS = ["Hello", " wörld", "😀", "", '"quoted" \\ back', "\x00\t\n\x1f", "\ud800 lone",
         "中文", "\u2028", "</script>"]


def _logprobs(ids: list[int], texts: list[str]) -> list[TokenLogprob]:
    return [TokenLogprob(i, t, -0.1 * (k + 1) / 3, k + 1,
                         [Candidate(i, t, -0.1 * (k + 1) / 3, 1),
                          Candidate(i + 7, "ß", -9999.0, 2), Candidate(i + 9, "\"", -1e-12, 3)])
            for k, (i, t) in enumerate(zip(ids, texts))]


def _deltas(n: int, logprobs: bool, finish: list[tuple[str, int | str | None]],
            texts: list[str] = TEXTS) -> list[ChoiceDelta]:
    out = []
    for step, text in enumerate(texts):
        for index in range(n):
            ids = [100 + step] if text or step % 2 else []
            out.append(ChoiceDelta(index, text, ids, num_cached_tokens=3,
                                   logprobs=_logprobs(ids, [text]) if logprobs else None,
                                   prompt_logprobs=(
                                       [TokenLogprob(1, "<s>"), *_logprobs([2, 3], ["a", "é"])]
                                       if step == 0 and logprobs else None)))
    for index in range(n):
        reason, stop = finish[index % len(finish)]
        out.append(ChoiceDelta(index, "end.", [9], reason, stop, 3,
                               logprobs=_logprobs([9], ["end."]) if logprobs else None))
    return out


def _head() -> ResponseHeader:
    return ResponseHeader("cmpl-é\"1", "mödel/😀", 1_700_000_123)


def _reference(chunks: list[dict]) -> bytes:
    """The SSE events as the stdlib writes them (what the stream sent before frames)."""
    return b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n"
                    for c in chunks)


def _assert_same(make, deltas: list[ChoiceDelta]) -> None:
    slow, fast = make(), make()
    seen = 0
    for delta in deltas:
        expected = _reference(slow.chunks(delta))
        assert fast.frames(delta) == expected, delta
        seen += bool(expected)
    assert seen >= len(deltas) // 2  # the cases do produce chunks
    usage = Usage(11, 22, 5, report_details=True)
    assert sse(fast.usage_chunk(usage)) == _reference([slow.usage_chunk(usage)])


FINISHES = [("stop", None), ("length", None), ("stop", 13), ("stop", "###\u00e9")]


@pytest.mark.parametrize("continuous", [True, False])
@pytest.mark.parametrize("num_top", [None, 0, 3])
@pytest.mark.parametrize("n", [1, 2])
def test_completion_frames_are_the_chunks_bytes(continuous, num_top, n):
    for as_ids in (False, True):
        for echoes in (None, ["Prompt ünï", "second \"prompt\""]):
            _assert_same(lambda: CompletionChunks(
                _head(), LogprobsFormat(num_top, as_ids), [7, 9], n, continuous, echoes=echoes),
                _deltas(n, num_top is not None, FINISHES))


@pytest.mark.parametrize("continuous", [True, False])
@pytest.mark.parametrize("num_top", [None, 0, 3])
@pytest.mark.parametrize("n", [1, 2])
def test_chat_frames_are_the_chunks_bytes(continuous, num_top, n):
    for as_ids in (False, True):
        for echo in ("", "Echöed \"last\" message"):
            _assert_same(lambda: ChatChunks(
                _head(), LogprobsFormat(num_top, as_ids), [7], n, continuous, echo=echo),
                _deltas(n, num_top is not None, FINISHES))


TOOL_TEXT = ['<think>I should', ' look ü up.</think>\n\n', '<tool_call>\n{"name": "get_',
             'weather", "arguments": {"city": "Par', 'is 😀"}}\n</tool_call>', '']


@pytest.mark.parametrize("include_reasoning", [True, False])
def test_chat_frames_with_reasoning_and_tool_calls(include_reasoning, monkeypatch):
    # Call ids are random: the same one in both renderers.
    monkeypatch.setattr(tool_base.uuid, "uuid4", lambda: uuid.UUID(int=0xC0FFEE))

    def make():
        output = ChatOutput(get_reasoning_parser("qwen3"), get_tool_parser("hermes"),
                            include_reasoning)
        return ChatChunks(_head(), LogprobsFormat(None), [7], 1, True, output=output)

    deltas = _deltas(1, False, [("stop", None)], TOOL_TEXT)
    _assert_same(make, deltas)
    renderer = make()  # the case does reach the tool call
    chunks = [c for d in deltas for c in renderer.chunks(d)]
    assert any("tool_calls" in c["choices"][0]["delta"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("payload", [
    {"error": {"message": "bad \"input\" ü\ud800", "type": "BadRequestError", "param": None,
               "code": 400}},
    {"a": [1, -0.0, 1e-300, 1.5e300, float("inf"), float("nan"), True, False, None],
     7: {"x": "y"}, "": []},
    "top-level 😀", 12, None, [],
])
def test_compact_json_is_json_dumps(payload):
    assert compact_json(payload) == json.dumps(payload, separators=(",", ":"))


def test_compact_json_refuses_what_json_dumps_refuses():
    with pytest.raises(TypeError, match="not JSON serializable"):
        compact_json({"a": object()})
