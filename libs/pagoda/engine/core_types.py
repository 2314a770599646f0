"""Messages in and out of the engine core (`EngineCore`), named by pipeline stage.

Past the tokenizer only token ids travel: an `EngineCoreRequest` carries the
prompt's token ids, and an `EngineCoreOutput` carries each step's new token ids.
Text, stop strings and detokenization live outside the core (the output
processor offline, the gateway + tokenizer service in the cluster).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagoda.sampling_params import SamplingParams
from pagoda.worker.runner_output import LogprobsLists


class FinishReason(enum.IntEnum):
    """Why a request stopped. `str()` gives the OpenAI `finish_reason`."""

    STOP = 0  # EOS, a stop token id, or a stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # client disconnect / abort / error

    def __str__(self) -> str:
        return self.name.lower()


@dataclass
class EngineCoreRequest:
    """A tokenized request entering a scheduler (one completion: the caller fans
    out `n > 1` into n requests)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.time)
    # Resumed requests (migration): tokens already generated elsewhere.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class EngineCoreOutput:
    """One request's progress in one step.

    `new_token_ids` may be empty (a partial prefill produces nothing, but a
    finished/aborted request still reports once with its finish_reason).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
