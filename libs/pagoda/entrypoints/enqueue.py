"""`LLM.enqueue` / `LLM.wait_for_completion` (vLLM's non-blocking offline pair).

`enqueue` adds requests to the engine and returns their ids at once; nothing runs
until `wait_for_completion`, which steps the engine until every enqueued request has
finished and returns their outputs sorted by request id, i.e. in the order they were
enqueued (vLLM's order). Requests enqueued several times before one wait all come
back from that wait. A blocking call (`generate`, `chat`) made in between runs the
enqueued requests too (one engine steps them all); their outputs are kept here for
the next `wait_for_completion`, and the blocking call returns only its own.
"""

from __future__ import annotations

from typing import Any, Sequence

from tqdm.auto import tqdm

from pagoda.entrypoints.prompts import Prompt, as_prompt_list, normalize_prompt
from pagoda.lora.request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams


class QueueMethods:
    """Mixed into `LLM`, which provides `llm_engine` and `_add_requests`."""

    llm_engine: Any

    def enqueue(self, prompts: Prompt | Sequence[Prompt],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                priority: list[int] | None = None, use_tqdm: bool = False) -> list[str]:
        """Add the prompts' requests without running them; their request ids, one per
        prompt, in order. Prompts and arguments as `generate`'s."""
        items = [normalize_prompt(p) for p in as_prompt_list(prompts)]
        order = self._add_requests(items, sampling_params, priority, lora_request)
        ids = sorted(order, key=order.__getitem__)
        self._enqueued().update(ids)
        return ids

    def wait_for_completion(self, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run until every enqueued request finished; their outputs, sorted by request
        id (the order they were enqueued)."""
        pending, done = self._enqueued(), self._enqueued_outputs()
        with tqdm(total=len(pending), initial=len(done), desc="Processed prompts",
                  disable=not use_tqdm) as bar:
            while len(done) < len(pending) and self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.request_id in pending:
                        done[output.request_id] = output
                        bar.update(1)
        outputs = [done[r] for r in sorted(done, key=_request_order)]
        pending.clear()
        done.clear()
        return outputs

    def _keep_enqueued_output(self, output: RequestOutput) -> bool:
        """Called by a blocking call for an output it did not ask for: kept for the next
        `wait_for_completion` (True) when it belongs to an enqueued request."""
        if output.request_id in self._enqueued():
            self._enqueued_outputs()[output.request_id] = output
            return True
        return False

    def _enqueued(self) -> set[str]:
        return self.__dict__.setdefault("_enqueued_ids", set())

    def _enqueued_outputs(self) -> dict[str, RequestOutput]:
        return self.__dict__.setdefault("_enqueued_done", {})


def _request_order(request_id: str) -> tuple[int, int | str]:
    """Engine ids are counters: numeric order; any other id after them, by text."""
    return (0, int(request_id)) if request_id.isdigit() else (1, request_id)
