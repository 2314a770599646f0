"""One completion's streaming decode, resumed on another tokenizer when its stream dies.

The incremental decoder of a completion lives in the tokenizer replica that its decode
stream reached; if that replica dies mid-answer, the completion starts over on the
next stream (another replica, round-robin) from the tokens already sent: one input
carrying the options and every token so far plus the new ones. The fresh decoder then
answers with the whole text so far; the part the client already has is cut off.

Invariant: the client's text is the same as without the failure. It holds because
decoding is a function of the token ids (the library's `StopAwareDecoder`, whatever
the batching): what was sent to the client is a prefix of the fresh decoder's text,
and no stop string matched in the replayed tokens (else the completion had ended).
If the prefix does not match, the completion fails with the usual 503 instead.
"""

from __future__ import annotations

import asyncio
import logging

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.gateway.generation.decode_mux import DecodeMux, DecodeStreamBroken

logger = logging.getLogger(__name__)
RESUME_ATTEMPTS = 3  # a new stream may meet the dead replica once more before it is skipped
RESUME_PAUSE_S = 0.1


class ResumableDecode:
    """The decode side of one completion: what it sent and what the client got."""

    def __init__(self, mux: DecodeMux, options: tpb.DecodeOptions) -> None:
        self.mux = mux
        self.options = options
        self.sent_token_ids: list[int] = []
        self._shown: list[str] = []  # the text handed to the client so far, in pieces

    async def decode(self, item: tpb.DecodeInput, token_ids: list[int] | None = None
                     ) -> tpb.DecodeResult:
        """`item`'s result, as if its stream had never broken. `token_ids`: the list
        `item.token_ids` was made from, when the caller has it (per token, extending
        from a list is ~1.4 us cheaper than from the message's repeated field)."""
        try:
            result = await self.mux.decode(item)
        except DecodeStreamBroken as exc:
            if not exc.stream_lost:
                raise
            result = await self._resume(item, exc)
        self.sent_token_ids.extend(item.token_ids if token_ids is None else token_ids)
        return result

    def shown(self, text: str) -> None:
        self._shown.append(text)  # joined only on a resume: a += per token is quadratic

    @property
    def shown_text(self) -> str:
        return "".join(self._shown)

    async def _resume(self, item: tpb.DecodeInput, exc: DecodeStreamBroken
                      ) -> tpb.DecodeResult:
        replay = tpb.DecodeInput()
        replay.CopyFrom(item)
        replay.options.CopyFrom(self.options)
        del replay.token_ids[:]
        replay.token_ids.extend([*self.sent_token_ids, *item.token_ids])
        for attempt in range(RESUME_ATTEMPTS):
            logger.warning("request %s: the decode stream broke (%s); resuming from %d tokens "
                           "on another stream", item.request_id, exc, len(self.sent_token_ids))
            try:
                return self._cut(await self.mux.decode(replay))
            except DecodeStreamBroken as again:
                if not again.stream_lost:
                    raise
                exc = again
            await asyncio.sleep(RESUME_PAUSE_S * (attempt + 1))
        raise exc

    def _cut(self, result: tpb.DecodeResult) -> tpb.DecodeResult:
        """The fresh decoder's answer less what the client already has."""
        field = "chunk" if result.HasField("chunk") else "complete"
        part = getattr(result, field)
        shown = self.shown_text
        if not part.text.startswith(shown):
            raise DecodeStreamBroken("the resumed decode disagrees with the text already "
                                     "sent", stream_lost=False)
        part.text = part.text[len(shown):]
        if field == "complete":
            part.num_tokens_used = max(0, part.num_tokens_used - len(self.sent_token_ids))
        return result
