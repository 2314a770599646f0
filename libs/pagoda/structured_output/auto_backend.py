"""`auto`, the default backend (vLLM's): per constraint, xgrammar when it takes the
constraint, else guidance.

xgrammar is the faster matcher for the common cases; it refuses what it cannot parse
and what it would compile without enforcing (`json_schema_support.py`: `multipleOf` on a
schema without a `type`, `allOf` with several members...), and llguidance enforces some
of those. A constraint both refuse is a 400 quoting both reasons, so a keyword neither
enforces (`not`, `if`/`then`/`else`, `uniqueItems`...) is named.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import (StructuredOutputBackend, StructuredOutputGrammar,
                                              backend_class)

FIRST, FALLBACK = "xgrammar", "guidance"


class AutoBackend(StructuredOutputBackend):
    """Invariants: `parse` returns (backend name, that backend's parse) and `compile`
    (name, compiled), so a constraint stays with one backend from intake to its last
    mask; each matcher's rows are filled by the backend that made it. xgrammar is
    built with this backend (at warm-up, as before); guidance the first time a
    constraint needs it (its tokenizer tables take about a second)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        self._args = (tokenizer, vocab_size, list(stop_token_ids))
        self._lock = threading.Lock()  # compile threads may ask for guidance together
        self._backends = {FIRST: backend_class(FIRST)(*self._args)}

    def backend(self, name: str) -> StructuredOutputBackend:
        with self._lock:
            if name not in self._backends:
                self._backends[name] = backend_class(name)(*self._args)
            return self._backends[name]

    @staticmethod
    def parse(params: StructuredOutputsParams) -> tuple[str, Any]:
        try:
            return FIRST, backend_class(FIRST).parse(params)
        except ValueError as first_error:
            try:
                return FALLBACK, backend_class(FALLBACK).parse(params)
            except ValueError as fallback_error:
                reason = getattr(fallback_error, "reason", str(fallback_error))
                raise ValueError(f"{first_error} The {FALLBACK} backend cannot take it "
                                 f"either: {reason}") from None

    def compile(self, parsed: tuple[str, Any]) -> tuple[str, Any]:
        name, grammar = parsed
        return name, self.backend(name).compile(grammar)

    def new_grammar(self, compiled: tuple[str, Any],
                    stop_token_ids: Sequence[int]) -> StructuredOutputGrammar:
        name, grammar = compiled
        return self.backend(name).new_grammar(grammar, stop_token_ids)

    def fill_bitmasks(self, grammars: Sequence[StructuredOutputGrammar],
                      bitmask: np.ndarray) -> None:
        rows_by_backend: dict[str, list[int]] = {}
        for row, grammar in enumerate(grammars):
            rows_by_backend.setdefault(grammar.backend, []).append(row)
        for name, rows in rows_by_backend.items():
            if len(rows) == len(grammars):  # one backend this step: its rows in place
                self.backend(name).fill_bitmasks(grammars, bitmask)
                return
            part = np.zeros((len(rows), bitmask.shape[1]), dtype=bitmask.dtype)
            self.backend(name).fill_bitmasks([grammars[row] for row in rows], part)
            bitmask[rows] = part
