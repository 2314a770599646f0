"""The scheduler's structured-output manager: compiles off the step, masks in the step.

    add_request ──parse (ms, ValueError = 400)──► pool: compile (once per constraint)
         │                                              │ Future, shared by equal keys
    schedule(): WAITING_FOR_GRAMMAR until the future is done ◄┘ (others go ahead)
         │ grammar ready: a matcher per request (n > 1: one per child)
    schedule(): bitmask rows of the constrained requests that sample this step
    update_from_output(): advance each matcher with the accepted token
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence

import numpy as np

import pagoda.fault_injection as fault_injection
from pagoda.config import StructuredOutputsConfig
from pagoda.reasoning import get_reasoning_parser
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import (StructuredOutputBackend, backend_class,
                                              bitmask_words)
from pagoda.structured_output.request import (GateMarkers, ReasoningGate,
                                              StructuredOutputRequest)

logger = logging.getLogger(__name__)
# Compiled grammars kept (a few MB at most each for a 50k vocabulary).
MAX_CACHED_GRAMMARS = 512


def constraint_key(params: StructuredOutputsParams) -> str:
    """The cache key: a hash of the constraint and the options that change its grammar.
    Key order inside a schema is kept (it orders the properties the grammar emits)."""
    text = json.dumps([params.kind, params.spec, params.disable_any_whitespace],
                      ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _marker_ids(tokenizer: Any, text: str) -> tuple[int, ...] | None:
    """`text`'s token ids as the model writes it: one vocabulary entry, or an encoding
    that decodes back to `text` and holds at least one added (special) token, which the
    model emits whole (harmony's `<|channel|>final`); None otherwise: plain text the
    model may spell in other tokens (`<think>` on a tokenizer without it) would let the
    gate miss the marker."""
    single = tokenizer.get_vocab().get(text)
    if single is not None:
        return (single,)
    ids = tokenizer.encode(text, add_special_tokens=False)
    added = set(getattr(tokenizer, "get_added_vocab", dict)().values())
    if not ids or not added.intersection(ids):
        return None
    if tokenizer.decode(ids, skip_special_tokens=False) != text:
        return None
    return tuple(ids)


def _compile(backend: Future, parsed: Any) -> Any:
    """On the pool: the backend's compilation of `parsed`."""
    if fault_injection.check("grammar.compile") == "fail":
        raise fault_injection.InjectedFault("injected fault: the compile failed")
    return backend.result().compile(parsed)


class StructuredOutputManager:
    """Owns the backend, the compile pool and the cache of compiled grammars.

    Invariants: a constraint compiles at most once while cached (`_compiled` maps its
    key to one Future, LRU-bounded; a failed compile is dropped so a retry recompiles);
    the backend (the tokenizer's vocabulary tables) is built once, on the pool; matchers
    are created and advanced on the caller's (engine) thread only.
    """

    def __init__(self, config: StructuredOutputsConfig, vocab_size: int,
                 load_tokenizer: Callable[[], Any], eos_token_ids: Sequence[int] = ()) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self._backend_cls_name = config.backend
        self._load_tokenizer = load_tokenizer
        self._eos = list(eos_token_ids)
        self._pool: ThreadPoolExecutor | None = None
        self._backend: Future | None = None
        self._lock = threading.Lock()  # guards lazy start-up (warm_up may race the engine)
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self._markers: GateMarkers | None = None  # the reasoning gate's, if gated
        # Why constrained requests are refused (None: they are not): the reasoning's
        # markers have no tokens, so the gate cannot see where the answer starts.
        self._no_gate: str | None = None
        if config.reasoning_parser and not config.enable_in_reasoning:
            self._markers = self._gate_markers(config.reasoning_parser)

    # ------------------------------------------------------------ start-up
    def _gate_markers(self, name: str) -> GateMarkers | None:
        """The parser's markers as token ids (gpt-oss's `<|channel|>final<|message|>` is
        three); None when a marker has no reliable tokenization (`_marker_ids`): the
        engine still serves, and a request with a constraint is refused, naming why
        (`init_request`)."""
        parser = get_reasoning_parser(name)
        tokenizer = self._load_tokenizer()
        end_parts = parser.gate_end_parts or (parser.end_token, "")
        texts = [parser.start_token, *end_parts, parser.gate_turn_start or ""]
        ids = [_marker_ids(tokenizer, t) if t else () for t in texts]
        if any(i is None for i in ids):
            self._no_gate = (
                f"structured_outputs with --reasoning-parser {name}: the tokenizer has no "
                f"{parser.start_token!r} / {parser.end_token!r} marker tokens, so the engine "
                "cannot tell where the reasoning ends and the constrained answer starts "
                "(not supported; --structured-outputs-config '{\"enable_in_reasoning\": "
                "true}' constrains the whole output instead).")
            return None
        starts_in = parser.gate_starts_in_reasoning
        return GateMarkers(start=ids[0], end=ids[1], end_suffix=ids[2],
                           end_gap=parser.gate_end_gap, turn_start=ids[3],
                           starts_in_reasoning=(parser.starts_in_reasoning if starts_in is None
                                                else starts_in))

    def warm_up(self) -> Future:
        """Start building the backend now (a served scheduler), not at the first request;
        the returned future is done when it is built (or failed: its requests fail)."""
        return self._backend_future()

    def _backend_future(self) -> Future:
        with self._lock:
            if self._backend is None:
                workers = max(1, min(4, (os.cpu_count() or 2) // 2))
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
                self._backend = self._pool.submit(self._make_backend)
            return self._backend

    def _make_backend(self) -> StructuredOutputBackend:
        return backend_class(self._backend_cls_name)(self._load_tokenizer(), self.vocab_size,
                                                     self._eos)

    @property
    def backend(self) -> StructuredOutputBackend:
        """Waits for the backend (a compile that finished has one)."""
        return self._backend_future().result()

    # ------------------------------------------------------------ intake
    def init_request(self, params: StructuredOutputsParams,
                     prompt_token_ids: Sequence[int]) -> StructuredOutputRequest:
        """Check the constraint (ValueError with the backend's reason) and start its
        compilation unless an equal one is compiled or compiling."""
        if self._no_gate is not None:
            raise ValueError(self._no_gate)
        key = constraint_key(params)
        future = self._compiled.get(key)
        if future is None:
            parsed = backend_class(self._backend_cls_name).parse(params)
            backend = self._backend_future()
            future = self._pool.submit(_compile, backend, parsed)
            self._compiled[key] = future
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        gate = None
        if self._markers is not None:
            gate = ReasoningGate(self._markers, prompt_token_ids)
        return StructuredOutputRequest(params, key, future, gate)

    def check_ready(self, so_request: StructuredOutputRequest, eos_token_ids: Sequence[int],
                    output_token_ids: Sequence[int]) -> str | None:
        """Whether the request's grammar is ready: sets its matcher on the first call
        after the compile finished. Returns None while compiling or when ready; the
        compile error otherwise (the request cannot run)."""
        if so_request.grammar is not None or not so_request.future.done():
            return None
        error = so_request.future.exception()
        if error is not None:
            if self._compiled.get(so_request.key) is so_request.future:
                del self._compiled[so_request.key]  # not cached: the next request retries
            return f"the grammar failed to compile: {error}"
        so_request.grammar = self.backend.new_grammar(so_request.future.result(),
                                                      eos_token_ids or self._eos)
        if output_token_ids and not so_request.advance(output_token_ids):
            return "the tokens already generated do not match the grammar"
        return None

    def wait_for_any(self, so_requests: Sequence[StructuredOutputRequest],
                     timeout: float) -> None:
        """Block until one of their compiles finishes or `timeout` passes (the engine
        has nothing else to run, and must not spin while the pool works)."""
        pending = {r.future for r in so_requests if not r.future.done()}
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------ step
    def grammar_bitmask(self, so_requests: Sequence[StructuredOutputRequest]) -> np.ndarray:
        """The packed bitmask rows (int32 [len, words]) of `so_requests`, in order; each
        must be `constrains_next_token`."""
        bitmask = np.zeros((len(so_requests), bitmask_words(self.vocab_size)), dtype=np.int32)
        self.backend.fill_bitmasks([r.grammar for r in so_requests], bitmask)
        bits = bitmask.view(np.uint32)
        for row, r in enumerate(so_requests):
            if r.may_open_reasoning:  # the answer may also open a thinking block (its
                # marker's first token: the gate reads the rest as reasoning)
                start = r.gate.start_id
                bits[row, start // 32] |= np.uint32(1 << (start % 32))
        return bitmask

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
