"""One completion's streaming-decode step as a `DecodeResult`: the same message whether
the tokenizer service's `DecodeStream` decodes it or a gateway does in its own process
(services/gateway/generation/local_decode.py), from the library's `StopAwareDecoder`.

Invariant: a finished step fills `complete` (all its text, the stop string that ended
it, the tokens used), any other step `chunk`; `decoded_tokens` holds one string per id
asked for, "" for an id outside the vocabulary.
"""

from __future__ import annotations

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb


class TokenStrings:
    """Each id decoded on its own, special tokens kept (vLLM's logprob token text),
    cached: decode([id]) is a pure function of the id."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = len(tokenizer)
        self._strs: dict[int, str] = {}

    def __call__(self, token_ids) -> list[str]:
        out = []
        for token_id in token_ids:
            text = self._strs.get(token_id)
            if text is None:
                if not 0 <= token_id < self._vocab_size:
                    out.append("")
                    continue
                text = self._strs[token_id] = self._tokenizer.decode([token_id])
            out.append(text)
        return out


def fill_decode_result(result: pb.DecodeResult, step, item: pb.DecodeInput,
                       token_strings: TokenStrings) -> None:
    """`result` (its request id set) from `step` (a `StopAwareDecoder` update for
    `item`)."""
    if item.decode_token_ids:
        result.decoded_tokens.extend(token_strings(item.decode_token_ids))
    if step.finished:
        complete = result.complete
        complete.text = step.text
        complete.stop_string = step.stop_str or ""
        complete.num_tokens_used = step.num_tokens_used
    else:
        result.chunk.text = step.text
