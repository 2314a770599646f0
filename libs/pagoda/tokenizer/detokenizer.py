"""Incremental (streaming) detokenization of one request's output tokens.

Plain Python over a Hugging Face tokenizer, one instance per request and no global state.
`StopAwareDecoder` (stop_aware_decoder.py) builds on it; callers use that.
"""

from __future__ import annotations

from typing import Any, Sequence

from pagoda.tokenizer.decode_plan import DecodeStream, decode_plan

# How many prompt tokens to decode in front of the first output token. Some decoders
# (SentencePiece's Metaspace, `Strip`) treat the first token of a decode call specially;
# giving them a little real context makes the first output token decode as it does inside
# the whole sequence. vLLM uses the same number (INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5

# What decoders produce for bytes that are not (yet) valid UTF-8.
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns output token ids into text deltas, a few tokens at a time.

    Invariants (tested in tests/tokenizer/test_detokenizer.py):
      * ``"".join(update(...) for each batch) + flush()`` is the text the output adds to
        the whole sequence's decode, ``decode(prompt + output)[len(decode(prompt)):]``, for
        any chunking. For byte-level BPE (GPT-2 / SmolLM2 / Llama-3 / Qwen2) that equals
        ``tokenizer.decode(output_ids, skip_special_tokens=...)`` for any token ids. For
        SentencePiece decoders (Llama-2 / Mistral) the first output token keeps its leading
        space (decoded alone it would lose it), and it holds for valid UTF-8 output: their
        byte-fallback decoder judges a run of byte tokens as a whole, so an invalid byte can
        retroactively turn an already complete character into U+FFFDs in a one-shot decode,
        which no streaming decoder can do. The prompt is assumed to decode cleanly (not to
        end in a partial character).
      * A delta never ends in a partial UTF-8 character: while the decoded window ends in
        U+FFFD, nothing is emitted; once the character completes, it is emitted whole.
        (Byte-fallback decoders write one U+FFFD per dangling byte, so nothing before the
        last U+FFFD is final either; holding the whole pending chunk is what keeps this
        exact for both decoder families.) `flush()` emits whatever is still held: the
        replacement characters that a one-shot decode would also produce.
      * Each step decodes a window of two short token runs (the chunk already emitted, for
        context, and the tokens not yet emitted), never the whole output: the cost per
        token is O(1) amortized. The window only grows while its text keeps ending in
        U+FFFD (real text does for at most three bytes; a run of invalid bytes from
        random ids can do it longer) or the new tokens add no text.

    This is vLLM's prefix_offset / read_offset algorithm: ``ids[prefix_offset:read_offset]``
    is the context chunk whose text has been emitted, ``ids[read_offset:]`` the pending
    tokens. Special tokens that `skip_special_tokens` drops are never put in the window
    (the Rust decoder drops exactly the added tokens marked special), so a run of them
    costs nothing.

    `spaces_between_special_tokens` only affects the slow (pure Python) tokenizers; the
    Rust decoders ignore it, as does vLLM's fast path.

    Where the tokenizer's decoder allows it (decode_plan.py), the same algorithm runs in
    Rust (`tokenizers.decoders.DecodeStream`: both decodes of a step in one call, about a
    third of the Python window's cost per token); the Python side then only tracks the
    token ids since the last emission, for `flush()` and for leaving the stream for the
    Python window (on a byte-fallback token, or if the stream refuses a step) in exactly
    the state the Python window would have reached. `native=False` forces the Python
    window (the reference the differential test compares with).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        native: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        plan = decode_plan(tokenizer)
        self._skipped_ids = plan.skipped_ids if skip_special_tokens else frozenset()
        self._token_ids: list[int] = []
        self._text = _TextAccumulator()
        self._flushed = False
        # The decode window: prompt tail first, then output tokens (skipped specials left out).
        prompt = [t for t in prompt_token_ids if t not in self._skipped_ids]
        self._window_ids = prompt[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:]
        self._read_offset = len(self._window_ids)
        prefix = self._decode(self._window_ids)
        self._prefix_len = len(prefix)
        # The native stream (None: the Python window). It would take a prompt tail that
        # ends in U+FFFD for no context at all, so such a prompt keeps the Python window.
        self._stream = None
        if native and plan.native and not prefix.endswith(REPLACEMENT_CHAR):
            self._stream = DecodeStream(ids=self._window_ids,
                                        skip_special_tokens=skip_special_tokens)
            self._byte_ids = plan.byte_ids
            # The stream's window, as the Python window holds it: the context chunk
            # (emitted) and the pending ids (held), skipped specials included.
            self._context_ids: list[int] = self._window_ids
            self._held_ids: list[int] = []

    # ------------------------------------------------------------------ public API
    @property
    def token_ids(self) -> list[int]:
        """All output token ids given so far, special tokens included."""
        return self._token_ids

    @property
    def output_text(self) -> str:
        """All text emitted so far: the concatenation of every delta returned."""
        return self._text.text

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Add output tokens; return the text they complete (possibly "")."""
        if self._flushed:
            raise RuntimeError("IncrementalDetokenizer.update() called after flush().")
        self._token_ids.extend(new_token_ids)
        if self._stream is not None:
            text = self._step_native(list(new_token_ids))
            if text is not None:
                return text
        kept = [t for t in new_token_ids if t not in self._skipped_ids]
        if not kept:
            return ""
        self._window_ids.extend(kept)
        text = self._decode(self._window_ids)
        if len(text) <= self._prefix_len or text.endswith(REPLACEMENT_CHAR):
            # Either an incomplete character is pending, or the tokens added no text yet
            # (a decoder may still attach it to a later token): hold everything.
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Emit the text still held back (a trailing incomplete character decodes to
        U+FFFD, as in a one-shot decode). Call once, when the request has finished."""
        if self._flushed:
            return ""
        self._flushed = True
        if self._stream is not None:
            self._leave_native()
        if self._read_offset == len(self._window_ids):
            return ""
        text = self._decode(self._window_ids)
        if len(text) <= self._prefix_len:
            return ""
        return self._emit(text)

    # ------------------------------------------------------------------ internals
    def _step_native(self, ids: list[int]) -> str | None:
        """One step of the native stream: its text ("" while held); None when the stream
        was left for the Python window, which must take these ids instead."""
        if not ids:
            return ""
        if self._byte_ids and not self._byte_ids.isdisjoint(ids):
            self._leave_native()
            return None
        try:
            text = self._stream.step(self._backend, ids[0] if len(ids) == 1 else ids)
        except Exception:  # noqa: BLE001 - InvalidPrefix: the Python window slices by chars
            self._leave_native()
            return None
        if text is None:
            self._held_ids += ids
            return ""
        if self._held_ids:
            ids = self._held_ids + ids
            self._held_ids = []
        self._context_ids = ids
        self._text.append(text)
        return text

    def _leave_native(self) -> None:
        """Continue in the Python window, in the state it would have reached."""
        skipped = self._skipped_ids
        context = [t for t in self._context_ids if t not in skipped]
        self._window_ids = context + [t for t in self._held_ids if t not in skipped]
        self._read_offset = len(context)
        self._prefix_len = len(self._decode(context))
        self._stream = None

    def _emit(self, text: str) -> str:
        """Emit `text` past the context chunk and slide the window: the pending tokens
        become the next context chunk."""
        delta = text[self._prefix_len:]
        del self._window_ids[: self._read_offset]
        self._read_offset = len(self._window_ids)
        # Decoded on its own (not sliced from `text`) so that the context chunk's text is
        # measured the way the next window will decode it, first-token quirks included.
        self._prefix_len = len(self._decode(self._window_ids))
        self._text.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )


class _TextAccumulator:
    """Append-only text kept as chunks and joined only when read, so that a long output
    costs O(1) per append instead of a full copy of the text on every token."""

    def __init__(self) -> None:
        self._chunks: list[str] = []
        self._joined = ""

    def append(self, chunk: str) -> None:
        if chunk:
            self._chunks.append(chunk)

    @property
    def text(self) -> str:
        if self._chunks:
            self._joined += "".join(self._chunks)
            self._chunks.clear()
        return self._joined
