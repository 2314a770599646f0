"""The guidance backend: llguidance (JSON schema, json_object, regex, choice, Lark or
GBNF grammars, and structural tags in their {"structures", "triggers"} form).

llguidance computes each mask on the fly (a lexer and an Earley parser walked over the
token trie, no per-grammar tables), so compiling a constraint is building one template
matcher (well under a millisecond for a typical schema) and each request gets a
`deep_copy` of it. It enforces JSON-schema keywords xgrammar drops (`multipleOf`,
`minimum`, `minLength`... on a schema without a `type`, `allOf` with several members)
and refuses, naming them, the ones it cannot enforce ("Unimplemented keys: [\"not\"]":
`not`, `if`/`then`/`else`, `uniqueItems`, `contains`, `dependentRequired`...; an unknown
`format`; a `$ref` to another document). `auto` relies on both halves, and
tests/structured_output/test_guidance_backend.py measures them against its matcher.

A `grammar` is Lark (a `start:` rule) or GBNF/EBNF (`root ::=`): llguidance's
`grammar_from` tells them apart and converts GBNF, as vLLM's guidance backend does.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

import llguidance as llg
import llguidance.hf
import llguidance.numpy
import numpy as np

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import (ConstraintRefused, StructuredOutputBackend,
                                              StructuredOutputGrammar)

logger = logging.getLogger(__name__)
# Threads filling one step's masks when several guidance rows sample (llguidance's executor).
MASK_THREADS = 4
# llguidance's messages can quote the whole grammar; the client needs the start.
MAX_REASON_CHARS = 1000


def _reason(message: str) -> str:
    """One line (an error JSON's message), at most MAX_REASON_CHARS."""
    message = " ".join(message.split())
    return message if len(message) <= MAX_REASON_CHARS else message[:MAX_REASON_CHARS] + " ..."


def _refused(kind: str, reason: str) -> ConstraintRefused:
    reason = _reason(reason)
    return ConstraintRefused(f"structured_outputs.{kind} is not a valid constraint for the "
                             f"guidance backend: {reason}", reason)


def _structural_tag(tag: dict) -> str:
    if "structures" not in tag or "triggers" not in tag:
        raise ValueError("the guidance backend takes a structural tag in its "
                         "{\"structures\", \"triggers\"} form only (xgrammar's \"format\" form "
                         "needs the xgrammar or auto backend)")
    tags = []
    for structure in tag["structures"]:
        begin = structure["begin"]
        trigger = next((t for t in tag["triggers"] if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger in {tag['triggers']} starts {begin!r}")
        tags.append(llg.StructTag(trigger=trigger, begin=begin, grammar=structure["schema"],
                                  end=structure["end"]))
    if not tags:
        raise ValueError("the structural tag has no structures")
    return llg.StructTag.to_grammar(tags)


def serialize(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (not yet checked)."""
    kind, spec = params.kind, params.spec
    whitespace = {"whitespace_flexible": not params.disable_any_whitespace}
    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(spec), defaults=whitespace)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=whitespace)
    if kind == "structural_tag":
        return _structural_tag(spec)
    return llg.grammar_from(kind, spec)  # "regex", "choice", "grammar": llguidance's names too


class GuidanceGrammar(StructuredOutputGrammar):
    """One request's `LLMatcher` and stop tokens.

    Invariants: a refused token never reaches the matcher (`validate_tokens` first: a
    refused `consume_token` would leave it in its error state), so refusing leaves the
    state unchanged; a stop token is accepted only where the grammar accepts the text,
    and nothing after it. llguidance's EOS tokens are the model's; when the request's
    stop tokens differ (`remap`), its masks are rewritten to allow those instead.
    """

    backend = "guidance"

    def __init__(self, matcher: llg.LLMatcher, stop_ids: frozenset[int],
                 eos_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.stop_ids, self.eos_ids = stop_ids, eos_ids
        self.remap = stop_ids != eos_ids
        self.terminated = False

    def accept_token(self, token_id: int) -> bool:
        if self.terminated:
            return False
        if token_id in self.stop_ids:
            if self.matcher.is_error():  # e.g. a parser limit hit: say why the text ends here
                logger.warning("guidance matcher: %s", _reason(self.matcher.get_error()))
                return False
            self.terminated = self.matcher.is_accepting()
            return self.terminated
        if token_id in self.eos_ids or self.matcher.validate_tokens([token_id]) != 1:
            return False
        return self.matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self.terminated

    def reset(self) -> None:
        self.matcher.reset()
        self.terminated = False

    def remap_stop_bits(self, row: np.ndarray) -> None:
        """The request's stop tokens allowed where llguidance allows its EOS, and only there."""
        bits = row.view(np.uint32)
        in_range = [t for t in self.eos_ids | self.stop_ids if t // 32 < len(bits)]
        may_end = any(bits[t // 32] >> np.uint32(t % 32) & 1 for t in in_range
                      if t in self.eos_ids)
        for t in in_range:
            bits[t // 32] &= ~np.uint32(1 << (t % 32))
        if may_end:
            for t in in_range:
                if t in self.stop_ids:
                    bits[t // 32] |= np.uint32(1 << (t % 32))


class GuidanceBackend(StructuredOutputBackend):
    """Invariants: one `LLTokenizer` for the model's vocabulary (`vocab_size` ids; the ids
    past the tokenizer's are never allowed) whose EOS tokens are the model's stop tokens;
    a compiled grammar is a template matcher that is only copied, never advanced."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids) or None)
        self.eos_ids = frozenset(self.ll_tokenizer.eos_tokens)
        self._executor = llg.LLExecutor(MASK_THREADS)

    @staticmethod
    def parse(params: StructuredOutputsParams) -> str:
        try:
            grammar = serialize(params)
        except (ValueError, TypeError, KeyError, AssertionError) as exc:
            raise _refused(params.kind, str(exc)) from None
        error = llg.LLMatcher.validate_grammar(grammar, None)
        if error:
            raise _refused(params.kind, error)
        return grammar

    def compile(self, parsed: str) -> llg.LLMatcher:
        """The template matcher; a grammar the vocabulary breaks (an unknown special
        token, say) raises here, which fails only its requests."""
        matcher = llg.LLMatcher(self.ll_tokenizer, parsed, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the guidance backend: {_reason(matcher.get_error())}")
        return matcher

    def new_grammar(self, compiled: llg.LLMatcher,
                    stop_token_ids: Sequence[int]) -> GuidanceGrammar:
        return GuidanceGrammar(compiled.deep_copy(), frozenset(stop_token_ids) or self.eos_ids,
                               self.eos_ids)

    def fill_bitmasks(self, grammars: Sequence[GuidanceGrammar], bitmask: np.ndarray) -> None:
        if len(grammars) == 1:  # no thread hand-off for the common single row
            llguidance.numpy.fill_next_token_bitmask(grammars[0].matcher, bitmask, 0)
        else:
            llguidance.numpy.fill_next_token_bitmask_par(
                self._executor, [(g.matcher, i) for i, g in enumerate(grammars)], bitmask)
        for row, grammar in enumerate(grammars):
            if grammar.remap:
                grammar.remap_stop_bits(bitmask[row])
