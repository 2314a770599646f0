"""Streamed (SSE) chunks of chat and completions responses, one renderer per request.

A renderer turns each `ChoiceDelta` into zero or more chunks and keeps what the
chunks of one choice continue from: whether the choice has started (chat's role
chunk, the echoed prompt), its text length so far (completions' `text_offset`)
and its token count (`continuous_usage_stats`). Every choice index gets its own
chunks, so `n > 1` interleaves them as they come.

`chunks(delta)` gives the chunk dicts; `frames(delta)` the same chunks as SSE
bytes, the stream's per-token path. Invariant: `frames(d)` is byte for byte
`b"".join(sse(c) for c in chunks(d))` on a renderer in the same state. It gets
there cheaper: what every chunk of a response repeats (id, object, created, model)
is encoded once per request, and only the choice (and the continuous usage) per
chunk, with the encoder json.dumps uses (JSON's encoding of an object is the
concatenation of its members' encodings, so splicing changes no byte). The commonest
delta (text, no logprobs, echo, usage or finish: one token of a plain stream) skips
the dicts too: `_plain_frame` writes its one choice's JSON with json.dumps' string
encoder, member for member what `_pieces` would have made.
"""

from __future__ import annotations

from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps' own string encoder

from pagoda.services.gateway.generation.choices import ChoiceDelta
from pagoda.services.gateway.openai.chat_output import ChatOutput, ChoiceOutputStream
from pagoda.services.gateway.openai.completion_bodies import (LogprobsFormat, ResponseHeader,
                                                              Usage, compact_json)
from pagoda.services.gateway.openai.logprobs import chat_logprobs, completion_logprobs


@dataclass
class _ChoiceState:
    started: bool = False
    text_len: int = 0
    num_tokens: int = 0


# One chunk before it is wrapped: its choice dict and, with continuous usage stats,
# (prompt_tokens, completion_tokens) as they were when the chunk was made.
_Piece = tuple[dict, "tuple[int, int] | None"]


class ChunkRenderer:
    """What both APIs' streams share: the header, per-choice state, usage."""

    object_name = ""

    def __init__(self, head: ResponseHeader, fmt: LogprobsFormat, prompt_lens: list[int], n: int,
                 continuous_usage: bool) -> None:
        self.head = head
        self.fmt = fmt
        self.prompt_lens = prompt_lens  # per prompt; choice i belongs to prompt i // n
        self.n = n
        self.continuous_usage = continuous_usage
        self._states: dict[int, _ChoiceState] = {}
        # `data: {"id":...,"model":...,"choices":[`: the same in every chunk.
        self._frame_head = ("data: " + compact_json(self._header())[:-1]
                            + ',"choices":[')

    def state(self, index: int) -> _ChoiceState:
        state = self._states.get(index)
        if state is None:
            state = self._states[index] = _ChoiceState()
        return state

    def chunks(self, d: ChoiceDelta) -> list[dict]:
        """The chunk dicts of `d` (and the renderer moves past it)."""
        return [self._chunk_dict(piece) for piece in self._pieces(d)]

    def frames(self, d: ChoiceDelta) -> bytes:
        """`d`'s chunks as SSE events, joined (b"" for none): see the module's invariant."""
        pieces = self._pieces(d)
        if len(pieces) == 1:
            return self._frame(pieces[0])
        return b"".join([self._frame(piece) for piece in pieces])

    def _pieces(self, d: ChoiceDelta) -> list[_Piece]:
        raise NotImplementedError

    def _piece(self, choice: dict) -> _Piece:
        if not self.continuous_usage:
            return choice, None
        # vLLM's continuous_usage_stats: this choice so far
        return choice, (self.prompt_lens[choice["index"] // self.n],
                        self.state(choice["index"]).num_tokens)

    def _header(self) -> dict:
        return {"id": self.head.id, "object": self.object_name, "created": self.head.created,
                "model": self.head.model}

    def _chunk_dict(self, piece: _Piece) -> dict:
        choice, usage = piece
        out = self._header()
        out["choices"] = [choice]
        if usage is not None:
            prompt, done = usage
            out["usage"] = {"prompt_tokens": prompt, "completion_tokens": done,
                            "total_tokens": prompt + done}
        return out

    def _frame(self, piece: _Piece) -> bytes:
        choice, usage = piece
        if usage is None:
            return f"{self._frame_head}{compact_json(choice)}]}}\n\n".encode()
        prompt, done = usage  # ints (lengths): their JSON is their str
        return (f'{self._frame_head}{compact_json(choice)}],"usage":{{"prompt_tokens":{prompt},'
                f'"completion_tokens":{done},"total_tokens":{prompt + done}}}}}\n\n').encode()

    def usage_chunk(self, usage: Usage) -> dict:
        """The last chunk with include_usage: the whole request's usage, no choices."""
        return {**self._header(), "choices": [], "usage": usage.as_dict()}


class CompletionChunks(ChunkRenderer):
    object_name = "text_completion"

    def __init__(self, *args, echoes: list[str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.echoes = echoes  # per prompt, when the request echoes
        # What `_plain_frame` needs: nothing but the text changes from chunk to chunk.
        self._plain = echoes is None and self.fmt.num_top is None and not self.continuous_usage

    def frames(self, d: ChoiceDelta) -> bytes:
        if self._plain and d.text and d.finish_reason is None and d.stop_reason is None:
            return self._plain_frame(d)
        return super().frames(d)

    def _plain_frame(self, d: ChoiceDelta) -> bytes:
        """`_pieces(d)`'s one chunk, as `_frame` would write it (the same state moves)."""
        st = self.state(d.index)
        st.started = True
        st.num_tokens += len(d.token_ids)
        st.text_len += len(d.text)
        return (f'{self._frame_head}{{"index":{d.index:d},"text":{_json_str(d.text)},'
                '"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n').encode()

    def _pieces(self, d: ChoiceDelta) -> list[_Piece]:
        st = self.state(d.index)
        text, tokens = d.text, d.logprobs or []
        if self.echoes is not None and not st.started:  # the prompt leads the first chunk
            text = self.echoes[d.index // self.n] + text
            tokens = [*(d.prompt_logprobs or []), *tokens]
        st.started = True
        st.num_tokens += len(d.token_ids)
        if not text and not tokens and d.finish_reason is None:
            return []
        logprobs = None
        if self.fmt.num_top is not None:
            logprobs = completion_logprobs(tokens, self.fmt.num_top, st.text_len,
                                           self.fmt.as_token_ids)
        st.text_len += len(text)
        return [self._piece({"index": d.index, "text": text, "logprobs": logprobs,
                             "finish_reason": d.finish_reason, "stop_reason": d.stop_reason})]


class ChatChunks(ChunkRenderer):
    object_name = "chat.completion.chunk"

    def __init__(self, *args, echo: str = "", output: ChatOutput | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo  # the last message's content, when the request echoes it
        # Reasoning and tool-call stages (chat_output.py); one stream per choice.
        self.output = output if output is not None and output.active else None
        self._outputs: dict[int, ChoiceOutputStream] = {}
        self._plain = self.output is None and self.fmt.num_top is None \
            and not self.continuous_usage

    def frames(self, d: ChoiceDelta) -> bytes:
        if self._plain and d.text and d.finish_reason is None:
            st = self._states.get(d.index)
            if st is not None and st.started:  # its role chunk went out
                st.num_tokens += len(d.token_ids)
                return (f'{self._frame_head}{{"index":{d.index:d},"delta":{{"content":'
                        f'{_json_str(d.text)}}},"logprobs":null,"finish_reason":null}}]}}'
                        '\n\n').encode()
        return super().frames(d)

    def _pieces(self, d: ChoiceDelta) -> list[_Piece]:
        st = self.state(d.index)
        out = []
        if not st.started:  # the first chunk of a choice names the role
            st.started = True
            out.append(self._choice(d.index, {"role": "assistant", "content": ""}))
            if self.echo:
                out.append(self._choice(d.index, {"content": self.echo}))
        st.num_tokens += len(d.token_ids)
        logprobs = None
        if self.fmt.num_top is not None and d.logprobs:
            logprobs = chat_logprobs(d.logprobs, self.fmt.num_top, self.fmt.as_token_ids)
        deltas, finish_reason = self._deltas(d)
        if logprobs and not deltas:
            deltas = [{"content": ""}]
        for j, delta in enumerate(deltas):  # a choice's logprobs ride its first delta
            out.append(self._choice(d.index, delta, logprobs=logprobs if j == 0 else None))
        if finish_reason is not None:
            out.append(self._choice(d.index, {}, finish_reason=finish_reason,
                                    stop_reason=d.stop_reason))
        return out

    def _deltas(self, d: ChoiceDelta) -> tuple[list[dict], str | None]:
        """The delta dicts of `d`'s text, and the choice's finish_reason if it ended."""
        if self.output is None:
            return ([{"content": d.text}] if d.text else []), d.finish_reason
        stream = self._outputs.setdefault(d.index, self.output.stream())
        deltas = stream.feed(d.text)
        if d.finish_reason is None:
            return deltas, None
        return deltas + stream.finish(), stream.finish_reason(d.finish_reason)

    def _choice(self, index: int, delta: dict, logprobs: dict | None = None,
                finish_reason: str | None = None, stop_reason: int | str | None = None
                ) -> _Piece:
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return self._piece(choice)
