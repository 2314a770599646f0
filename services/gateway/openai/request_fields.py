"""vLLM's prompt-side request fields, applied where the gateway has just tokenized.

* `truncate_prompt_tokens`: each prompt keeps its last N tokens (-1: the context
  length), the rule the offline engine applies too (`pagoda.tokenizer.truncation`).
  A truncated prompt drops the block hashes the tokenizer computed for the whole one
  (the router hashes the ids it routes by itself when it needs them).
* `bad_words`: encoded by the tokenizer service, one Tokenize call per spelling, all
  at once, then combined by the library's rule (`pagoda.tokenizer.bad_words`) into
  the `bad_words_token_ids` the scheduler's sampler bans.

Both raise APIError (400) naming the field, before anything is submitted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pagoda.sampling_params import check_bad_words
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.gateway.errors import APIError
from pagoda.tokenizer.bad_words import bad_word_texts, bad_words_token_ids
from pagoda.tokenizer.truncation import truncate_prompt


Tokenize = Callable[[Any, tpb.TokenizeRequest], Awaitable[tpb.TokenizeResponse]]


async def apply_prompt_fields(state: Any, body: Any, prompts: Sequence[Any],
                              tokenize: Tokenize) -> None:
    """Truncate `prompts` (`Prompt`s, in place) and encode `body.bad_words` into the
    body's `bad_words_token_ids` (what `to_sampling_params` sends). `tokenize(state,
    request)` is the routes' Tokenize call (errors already APIErrors)."""
    info = state.peers.model_info()
    if body.truncate_prompt_tokens is not None:
        for prompt in prompts:
            try:
                kept = truncate_prompt(prompt.token_ids, body.truncate_prompt_tokens,
                                       info.max_model_len)
            except ValueError as exc:
                raise APIError(str(exc), param="truncate_prompt_tokens") from None
            if len(kept) < len(prompt.token_ids):
                prompt.token_ids, prompt.block_hashes = kept, None
    if body.bad_words:
        body.set_bad_words_token_ids(await encode_bad_words(state, body.bad_words, tokenize))


async def encode_bad_words(state: Any, bad_words: list[str],
                           tokenize: Tokenize) -> list[list[int]]:
    try:
        check_bad_words(bad_words)  # SamplingParams' rule, needed before they are encoded
    except ValueError as exc:
        raise APIError(str(exc), param="bad_words") from None
    texts = bad_word_texts(bad_words)
    replies = await asyncio.gather(*(tokenize(state, tpb.TokenizeRequest(
        prompt=text, add_special_tokens=False)) for text in texts))
    encoded = {text: list(reply.token_ids) for text, reply in zip(texts, replies)}
    vocab_size = state.peers.tokenizer_info().vocab_size
    try:
        return bad_words_token_ids(bad_words, encoded.__getitem__, vocab_size)
    except ValueError as exc:
        raise APIError(str(exc), param="bad_words") from None
