"""Streamed (SSE) chunks of chat and completions responses, one renderer per request.

A renderer turns each `ChoiceDelta` into zero or more chunk dicts and keeps what
the chunks of one choice continue from: whether the choice has started (chat's
role chunk, the echoed prompt), its text length so far (completions'
`text_offset`) and its token count (`continuous_usage_stats`). Every choice index
gets its own chunks, so `n > 1` interleaves them as they come.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.services.gateway.generation.choices import ChoiceDelta
from pagoda.services.gateway.openai.chat_output import ChatOutput, ChoiceOutputStream
from pagoda.services.gateway.openai.completion_bodies import LogprobsFormat, ResponseHeader, Usage
from pagoda.services.gateway.openai.logprobs import chat_logprobs, completion_logprobs


@dataclass
class _ChoiceState:
    started: bool = False
    text_len: int = 0
    num_tokens: int = 0


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

    def state(self, index: int) -> _ChoiceState:
        return self._states.setdefault(index, _ChoiceState())

    def chunk(self, choice: dict) -> dict:
        out = {"id": self.head.id, "object": self.object_name, "created": self.head.created,
               "model": self.head.model, "choices": [choice]}
        if self.continuous_usage:  # vLLM's continuous_usage_stats: this choice so far
            prompt = self.prompt_lens[choice["index"] // self.n]
            done = self.state(choice["index"]).num_tokens
            out["usage"] = {"prompt_tokens": prompt, "completion_tokens": done,
                            "total_tokens": prompt + done}
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        """The last chunk with include_usage: the whole request's usage, no choices."""
        return {"id": self.head.id, "object": self.object_name, "created": self.head.created,
                "model": self.head.model, "choices": [], "usage": usage.as_dict()}


class CompletionChunks(ChunkRenderer):
    object_name = "text_completion"

    def __init__(self, *args, echoes: list[str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.echoes = echoes  # per prompt, when the request echoes

    def chunks(self, d: ChoiceDelta) -> list[dict]:
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
        return [self.chunk({"index": d.index, "text": text, "logprobs": logprobs,
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

    def chunks(self, d: ChoiceDelta) -> list[dict]:
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
                finish_reason: str | None = None, stop_reason: int | str | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return self.chunk(choice)
