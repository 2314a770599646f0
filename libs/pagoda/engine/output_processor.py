"""Turns the core's token-id deltas into vLLM-shaped `RequestOutput`s (offline path).

Detokenization and stop strings live here, outside the core, in the same
`StopAwareDecoder` the tokenizer service runs for served requests: when a stop
string completes, the request is reported finished with finish_reason "stop", the
tokens after the one that completed it are dropped, and its id is returned so the
caller aborts it in the core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagoda.logprobs import new_logprobs_container
from pagoda.messages import EngineCoreOutput, FinishReason, LogprobsLists
from pagoda.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer.stop_aware_decoder import StopAwareDecoder


@dataclass
class ParentRequest:
    """One user request; its `n` completions run as `n` core requests."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    num_unfinished: int = 0
    arrival_time: float = field(default_factory=time.time)


@dataclass
class ChildState:
    parent: ParentRequest
    index: int
    decoder: StopAwareDecoder


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


class OutputProcessor:
    """Invariant: a parent is returned finished exactly once, when all its children are."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.children: dict[str, ChildState] = {}

    def add_request(self, parent: ParentRequest) -> list[str]:
        """Registers the parent; returns its children's core request ids."""
        n = parent.params.n
        parent.num_unfinished = n
        if parent.params.prompt_logprobs is not None:
            parent.prompt_logprobs = new_logprobs_container(parent.params.flat_logprobs,
                                                            prompt=True)
        ids = []
        for index in range(n):
            child_id = child_request_id(parent.request_id, index, n)
            decoder = StopAwareDecoder.from_sampling_params(
                self.tokenizer, parent.prompt_token_ids, parent.params)
            parent.completions.append(CompletionOutput(
                index, "", [], 0.0 if parent.params.logprobs is not None else None,
                new_logprobs_container(parent.params.flat_logprobs)
                if parent.params.logprobs is not None else None))
            self.children[child_id] = ChildState(parent, index, decoder)
            ids.append(child_id)
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.children)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (finished parents' outputs, child ids to abort in the core)."""
        finished: list[RequestOutput] = []
        to_abort: list[str] = []
        for out in outputs:
            child = self.children.get(out.request_id)
            if child is None:
                continue  # already ended by a stop string
            parent, completion = child.parent, child.parent.completions[child.index]
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.new_prompt_logprobs is not None and parent.prompt_logprobs is not None and child.index == 0:
                parent.prompt_logprobs.extend(self._to_logprobs(out.new_prompt_logprobs))
            step = child.decoder.update(out.new_token_ids, finished=out.finished,
                                        stop_terminated=out.finish_reason == FinishReason.STOP)
            new_token_ids = out.new_token_ids[:step.num_tokens_used]
            completion.token_ids.extend(new_token_ids)
            if out.new_logprobs is not None and completion.logprobs is not None:
                positions = self._to_logprobs(out.new_logprobs)[:step.num_tokens_used]
                completion.logprobs.extend(positions)
                completion.cumulative_logprob += sum(p[t].logprob for p, t in
                                                    zip(positions, new_token_ids))
            if step.stop_str is not None:  # wins over length in the same step, as in vLLM
                completion.finish_reason, completion.stop_reason = "stop", step.stop_str
                if not out.finished:
                    to_abort.append(out.request_id)
            elif out.finished:
                completion.finish_reason, completion.stop_reason = str(out.finish_reason), out.stop_reason
            if completion.finish_reason is not None:
                completion.text = child.decoder.output_text
                del self.children[out.request_id]
                parent.num_unfinished -= 1
                if parent.num_unfinished == 0:
                    finished.append(self._make_output(parent))
        return finished, to_abort

    def _to_logprobs(self, lists: LogprobsLists) -> list[PositionLogprobs]:
        positions = []
        for ids, lps, ranks in zip(lists.token_ids, lists.logprobs, lists.ranks):
            entry: PositionLogprobs = {}
            for tid, lp, rank in zip(ids, lps, ranks):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank, self.tokenizer.decode([tid]))
            positions.append(entry)
        return positions

    @staticmethod
    def _make_output(parent: ParentRequest) -> RequestOutput:
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             parent.prompt_logprobs, parent.completions, True, parent.num_cached_tokens)
