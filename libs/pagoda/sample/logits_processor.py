"""vLLM v1's custom logits-processor interface (`vllm.v1.sample.logits_processor`).

A custom processor is a class, loaded once per engine (`LLM(logits_processors=[...])`,
`--logits-processors`: classes or fully qualified class names), built as
`cls(vllm_config, device, is_pin_memory)` in the worker that samples. Each step the
worker first tells it how the persistent batch changed (`update_state(BatchUpdate |
None)`), then hands it the logits of that batch (`apply(logits) -> logits`), row i
being persistent-batch index i. A processor keeps per-row state keyed by index; the
`output_tok_ids` list of an added request is the request's live output list, so it
always sees the tokens generated so far.

`BatchUpdate` operations are applied in vLLM's order: removed, then added (an added
request may take a removed index), then moved, one after another.
"""

from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.sampling_params import SamplingParams


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # a -> b; index a is left empty
    SWAP = enum.auto()  # a <-> b


# (index, params, prompt token ids, the request's live output token list)
AddedRequest = tuple[int, SamplingParams, "list[int] | None", "list[int]"]
MovedRequest = tuple[int, int, MoveDirectionality]
RemovedRequest = int


@dataclass(frozen=True)
class BatchUpdate:
    """How the persistent batch changed since the previous step."""

    batch_size: int  # requests in the batch after the update
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """Subclass this (or write a class with the same methods: they are duck-typed)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError for a request this processor cannot serve (checked when the
        request is added, so the caller gets the error, not the engine)."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's logits [batch_size, vocab], processed (in place or a new tensor)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if it never changes a row's argmax (then greedy rows may skip it)."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called once per step before `apply`; None when the batch did not change."""
        raise NotImplementedError


_REQUIRED = ("apply", "is_argmax_invariant", "update_state")


def resolve_logits_processor_classes(specs: Sequence[Any] | None) -> tuple[type, ...]:
    """Classes from classes or "package.module.ClassName" strings (vLLM's
    `logits_processors`). ValueError naming the entry that is not a usable class."""
    classes = []
    for spec in specs or ():
        cls = _import(spec) if isinstance(spec, str) else spec
        if not isinstance(cls, type) or any(not callable(getattr(cls, m, None)) for m in _REQUIRED):
            raise ValueError(f"logits_processors: {spec!r} is not a logits processor class "
                             f"(it needs {', '.join(_REQUIRED)})")
        classes.append(cls)
    return tuple(classes)


def _import(name: str) -> type:
    module_name, _, attr = name.rpartition(".")
    if not module_name:
        raise ValueError(f"logits_processors: {name!r} is not a fully qualified class name "
                         "(package.module.ClassName)")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"logits_processors: cannot load {name!r}: {exc}") from None


def validate_request_params(classes: Sequence[type], params: SamplingParams) -> None:
    """Each processor's `validate_params` on a new request (vLLM calls it on intake)."""
    for cls in classes:
        validate = getattr(cls, "validate_params", None)
        if validate is not None:
            validate(params)
