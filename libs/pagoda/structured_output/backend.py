"""The grammar backend interface, and the registry `--structured-outputs-config` picks from.

`xgrammar` and `guidance` (llguidance) force one backend; `auto` (the default, vLLM's)
picks one per constraint: xgrammar when it enforces it, else guidance (`auto_backend.py`).

A backend turns a `StructuredOutputsParams` into a compiled grammar (once per distinct
constraint, on the manager's thread pool) and a compiled grammar into per-request
matchers (`StructuredOutputGrammar`), which the scheduler advances token by token and
asks for the packed bitmask of the tokens allowed next.

Bitmask layout (xgrammar's, which the worker unpacks in `pagoda.sample.grammar`): row r
is `ceil(vocab_size / 32)` int32 words; token t is allowed when bit `t % 32` of word
`t // 32` is set.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np

from pagoda.sampling_params import StructuredOutputsParams

# Backend name -> "module:class" (imported only when picked: each loads its grammar engine).
BACKENDS = {"xgrammar": "pagoda.structured_output.xgrammar_backend:XgrammarBackend",
            "guidance": "pagoda.structured_output.guidance_backend:GuidanceBackend"}
AUTO = "auto"
_AUTO_BACKEND = "pagoda.structured_output.auto_backend:AutoBackend"


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def resolve_backend_name(name: str) -> str:
    """`name` if Pagoda has it (`auto` included); else ValueError listing the known ones."""
    if name != AUTO and name not in BACKENDS:
        raise ValueError(f"structured outputs backend {name!r} is not supported; Pagoda has "
                         f"{', '.join([AUTO, *BACKENDS])}.")
    return name


def backend_class(name: str) -> type["StructuredOutputBackend"]:
    path = _AUTO_BACKEND if resolve_backend_name(name) == AUTO else BACKENDS[name]
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


class ConstraintRefused(ValueError):
    """A backend's refusal of a constraint (a 400): `str()` is the whole message,
    `reason` the backend's own words (what `auto` quotes when both backends refuse)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class StructuredOutputGrammar(ABC):
    """One request's matcher.

    Invariant: the tokens accepted so far are a prefix of some text the constraint
    allows; a token it refuses leaves the state unchanged. `backend` names the backend
    that made it (`auto` sends each matcher back to its own backend for its mask).
    """

    backend: str = ""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar accepted a stop token: nothing may follow."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the state before the first token."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer vocabulary; thread-safe `compile`."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size

    @staticmethod
    @abstractmethod
    def parse(params: StructuredOutputsParams) -> Any:
        """Check the constraint without the vocabulary (cheap: no compilation); return
        what `compile` takes. Raises ValueError with the backend's reason."""

    @abstractmethod
    def compile(self, parsed: Any) -> Any:
        """The vocabulary-dependent compilation of `parse`'s result (seconds for a big
        schema, hence on a thread pool)."""

    @abstractmethod
    def new_grammar(self, compiled: Any, stop_token_ids: Sequence[int]) -> StructuredOutputGrammar:
        """A fresh matcher; `stop_token_ids` (the request's EOS ids) may end the text
        once the grammar accepts it, and only then."""

    @abstractmethod
    def fill_bitmasks(self, grammars: Sequence[StructuredOutputGrammar],
                      bitmask: np.ndarray) -> None:
        """Row i of `bitmask` (int32, [len(grammars), bitmask_words]) := the tokens
        `grammars[i]` allows next."""
