"""Incremental decode in the gateway's own process: a `DecodeMux` without the hop.

Through the tokenizer service, every engine step costs one `DecodeStream` exchange:
a gRPC write and read here and a message there, in a process that wakes for it once
a step. On a CPU host the model's threads pay for each such wake-up (measured on the
default model at concurrency 32: ~1 ms of control-plane CPU a step, landing inside the
next step). When the tokenizer service offers its tokenizer's path
(`GetTokenizerInfo.tokenizer_path`) and this process can read it, the gateway loads
the same tokenizer and decodes here with the service's own code
(`TokenizerServicer._decode_one`: the same `StopAwareDecoder`, so byte for byte the
same text, stop strings and token strings). `PAGODA_GATEWAY_LOCAL_DETOKENIZE=0`
keeps every decode on the service.

Invariant: `decode(item)` gives what the service's `DecodeStream` gives for the same
sequence of inputs (a result per non-release input of a live completion; a
`DecodeStreamBroken(stream_lost=False)` for an input of an unknown completion, as
`DecodeMux` raises when the service returns no result for it).
"""

from __future__ import annotations

import logging
import os

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb
from pagoda.services.gateway.generation.decode_mux import DecodeStreamBroken

logger = logging.getLogger(__name__)

ENV = "PAGODA_GATEWAY_LOCAL_DETOKENIZE"


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class LocalDecodeMux:
    """`DecodeMux`'s interface over an in-process tokenizer servicer."""

    def __init__(self, servicer) -> None:
        self._servicer = servicer
        self._decoders: dict = {}  # request id -> its StopAwareDecoder, as the stream keeps them

    async def decode(self, item: pb.DecodeInput) -> pb.DecodeResult:
        response = pb.DecodeStreamResponse()
        self._servicer._decode_one(self._decoders, item, response.results.add)
        if not response.results:
            raise DecodeStreamBroken(f"no result for {item.request_id}", stream_lost=False)
        return response.results[0]

    def release(self, request_id: str) -> None:
        self._decoders.pop(request_id, None)

    async def close(self) -> None:
        self._decoders.clear()


def load_local_mux(info: pb.GetTokenizerInfoResponse) -> LocalDecodeMux | None:
    """A LocalDecodeMux over the tokenizer at `info.tokenizer_path`, or None when it is
    not offered, not readable here, or not the service's (another vocabulary size).
    Blocking (seconds for a cold tokenizer): run it off the event loop."""
    path = info.tokenizer_path
    if not enabled() or not path or not os.path.exists(path):
        return None
    # lazy: transformers and the tokenizer service's code only where they are used
    from pagoda.services.tokenizer.servicer import TokenizerServicer
    from pagoda.tokenizer.loader import load_tokenizer

    try:
        tokenizer = load_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - the service still decodes
        logger.warning("cannot load the tokenizer at %s here (%r): detokenizing on the "
                       "tokenizer service", path, exc)
        return None
    if len(tokenizer) != info.vocab_size:
        logger.warning("the tokenizer at %s here has %d tokens, the service's %d: "
                       "detokenizing on the tokenizer service", path, len(tokenizer),
                       info.vocab_size)
        return None
    logger.info("detokenizing in the gateway's process (tokenizer at %s; %s=0 sends it to "
                "the tokenizer service)", path, ENV)
    return LocalDecodeMux(TokenizerServicer(tokenizer, info.model, list(info.eos_token_ids)))
