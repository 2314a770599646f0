"""The xgrammar backend: JSON schema, regex, choice, EBNF and structural tags.

xgrammar (the grammar engine vLLM uses by default) compiles a constraint against the
tokenizer's vocabulary once and then answers "which tokens may come next" for a
pushdown automaton in microseconds, on the CPU, as a packed bitmask. `parse` runs
without the vocabulary (milliseconds), which is what the engine's intake uses to refuse
an invalid constraint before it is queued.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

import numpy as np
import xgrammar as xgr

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from pagoda.structured_output.json_schema_support import unenforced_keywords

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:line: " and sometimes a
# "Check failed: (...) is false: " preamble; the client needs only the reason.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")
# The threads one compilation may use (xgrammar parallelises over the vocabulary).
COMPILER_THREADS = 4


def _reason(exc: Exception) -> str:
    return _LOG_PREFIX.sub("", str(exc).strip()).strip()


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose root is exactly one of `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _structural_tag(tag: dict) -> xgr.Grammar:
    if "structures" in tag:  # the older form vLLM and OpenAI clients still send
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                       end=s["end"]) for s in tag["structures"]]
        return xgr.Grammar.from_structural_tag(items, list(tag["triggers"]))
    return xgr.Grammar.from_structural_tag(json.dumps(tag))


def _refuse_unenforced(schema: Any) -> None:
    """A schema part xgrammar would compile and ignore is refused (ValueError: a 400),
    never served unenforced (json_schema_support.py)."""
    unenforced = unenforced_keywords(schema)
    if unenforced:
        raise ValueError(f"structured_outputs.json: the xgrammar backend cannot enforce "
                         f"{'; '.join(unenforced[:5])}, so the output could break the "
                         f"schema; remove or rewrite that part.")


class XgrammarGrammar(StructuredOutputGrammar):
    """A `GrammarMatcher` (one per request; they share the compiled grammar)."""

    backend = "xgrammar"

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    """Invariant: one `GrammarCompiler` for the model's vocabulary (`vocab_size` is the
    model's, which may exceed the tokenizer's length; the extra ids are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        # xgrammar's own cache stays off: the manager caches compiled grammars by key.
        self.compiler = xgr.GrammarCompiler(info, max_threads=COMPILER_THREADS,
                                            cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher()

    @staticmethod
    def parse(params: StructuredOutputsParams) -> xgr.Grammar:
        kind, spec = params.kind, params.spec
        if kind == "json":
            _refuse_unenforced(spec)
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(
                    json.dumps(spec), any_whitespace=not params.disable_any_whitespace)
            if kind == "json_object":
                return xgr.Grammar.from_json_schema(
                    '{"type": "object"}', any_whitespace=not params.disable_any_whitespace,
                    strict_mode=False)
            if kind == "regex":
                return xgr.Grammar.from_regex(spec)
            if kind == "choice":
                return xgr.Grammar.from_ebnf(choice_grammar(spec))
            if kind == "grammar":
                return xgr.Grammar.from_ebnf(spec)
            return _structural_tag(spec)
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"structured_outputs.{kind} is not a valid constraint for the "
                             f"xgrammar backend: {_reason(exc)}") from None

    def compile(self, parsed: xgr.Grammar) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(parsed)

    def new_grammar(self, compiled: xgr.CompiledGrammar,
                    stop_token_ids: Sequence[int]) -> XgrammarGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(
            compiled, override_stop_tokens=sorted(stop_token_ids) or None))

    def fill_bitmasks(self, grammars: Sequence[XgrammarGrammar], bitmask: np.ndarray) -> None:
        if len(grammars) == 1:  # no thread hand-off for the common single row
            grammars[0].matcher.fill_next_token_bitmask(bitmask, 0)
            return
        self._batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)
