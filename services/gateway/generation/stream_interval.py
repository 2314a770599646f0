"""vLLM's `--stream-interval N`: a choice's deltas go out every N tokens, not every token.

Every delta costs the gateway about the same whatever it carries (its chunk's JSON, the
write) and the client again (the parse). Served at 32 streams on the 2-core machine, the
gateway spent 95-101 us of CPU per token at N = 1 and 74-90 at N = 8 (stop 45). With
N > 1 a choice sends:
  * its first delta at once (the time to first token does not change);
  * then one delta once N tokens have gathered;
  * its last delta (the finish reason) as soon as it comes, with whatever was held.

Coalescing runs after decoding (`stream_choice` has already turned tokens into text),
so a stop string is still caught at the token that completes it, as at N = 1: the
request is aborted just as soon and no text past the stop string is ever held.

Invariants:
  * the text, token ids and logprobs of the deltas sent are those of the deltas
    received, joined in order: nothing dropped, nothing reordered;
  * a delta with a finish reason is never held;
  * when the choice fails (the replica is gone with migration used up, the decode
    stream broke), what was held goes out before the error does: the client sees every
    token it would have seen at N = 1.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (serving_options.py imports this module, and choices.py imports it back)
    from pagoda.services.gateway.generation.choices import ChoiceDelta

DEFAULT_STREAM_INTERVAL = 1


def join_deltas(first: ChoiceDelta, then: ChoiceDelta) -> ChoiceDelta:
    """One delta carrying `first` followed by `then` (same choice); the later one's
    finish, stop reason and cached-token count, the prompt's logprobs from whichever
    carries them (they come once)."""
    if first.logprobs is not None and then.logprobs is not None:
        logprobs = first.logprobs + then.logprobs
    else:
        logprobs = first.logprobs if then.logprobs is None else then.logprobs
    prompt_logprobs = (first.prompt_logprobs if first.prompt_logprobs is not None
                       else then.prompt_logprobs)
    return replace(then, text=first.text + then.text, token_ids=first.token_ids + then.token_ids,
                   logprobs=logprobs, prompt_logprobs=prompt_logprobs)


async def coalesce_deltas(deltas: AsyncIterator[ChoiceDelta], interval: int
                          ) -> AsyncIterator[ChoiceDelta]:
    """`deltas` (one choice's) sent every `interval` tokens; see the module's rules.
    Closing this closes `deltas` (which aborts the request in the scheduler)."""
    held: ChoiceDelta | None = None
    sent_any = False
    try:
        while True:
            try:
                delta = await deltas.__anext__()
            except StopAsyncIteration:
                break
            except Exception:
                if held is not None:  # the tokens the client would have had, then the error
                    pending, held = held, None
                    yield pending
                raise
            if held is not None:
                delta = join_deltas(held, delta)
                held = None
            if not sent_any or delta.finish_reason is not None \
                    or len(delta.token_ids) >= interval:
                sent_any = True
                yield delta
            else:
                held = delta
        if held is not None:  # the stream ended without a finish (the caller reports it)
            yield held
    finally:
        await deltas.aclose()
