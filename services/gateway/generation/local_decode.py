"""Incremental decode in the gateway's own process: a `DecodeMux` without the hop.

Through the tokenizer service, every engine step costs one `DecodeStream` exchange:
a gRPC write and read here and a message there, in a process that wakes for it once
a step. On a CPU host the model's threads pay for each such wake-up (measured on the
default model at concurrency 32: ~1 ms of control-plane CPU a step, landing inside the
next step). When the tokenizer service offers its tokenizer's path
(`GetTokenizerInfo.tokenizer_path`) and this process can read it, the gateway loads
the same tokenizer and decodes here with the library's `StopAwareDecoder`, as the
service's `TokenizerServicer._decode_one` does (services import no other service's
code, so `decode` restates its few lines; tests/services/gateway/test_local_decode.py
holds the two to the same results, message for message).
`PAGODA_GATEWAY_LOCAL_DETOKENIZE=0` keeps every decode on the service.

Invariant: it is built only over a tokenizer with the service's fingerprint, and
`decode(item)` gives what the service's `DecodeStream` gives for the same sequence of
inputs (a result per non-release input of a live completion; a
`DecodeStreamBroken(stream_lost=False)` for an input of an unknown completion, as
`DecodeMux` raises when the service returns no result for it).
"""

from __future__ import annotations

import logging
import os

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb
from pagoda.services.common.protocol.decode_results import TokenStrings, fill_decode_result
from pagoda.services.common.protocol.sampling_params import decode_options_from_proto
from pagoda.services.gateway.generation.decode_mux import DecodeStreamBroken
from pagoda.tokenizer.fingerprint import tokenizer_fingerprint
from pagoda.tokenizer.stop_aware_decoder import StopAwareDecoder

logger = logging.getLogger(__name__)

ENV = "PAGODA_GATEWAY_LOCAL_DETOKENIZE"


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class LocalDecodeMux:
    """`DecodeMux`'s interface over an in-process tokenizer."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoders: dict[str, StopAwareDecoder] = {}  # by request id, as the stream keeps them
        self._token_strings = TokenStrings(tokenizer)

    async def decode(self, item: pb.DecodeInput) -> pb.DecodeResult:
        request_id = item.request_id
        decoder = self._decoders.get(request_id)
        if decoder is None:
            if not item.HasField("options"):  # a completion already complete: no result
                raise DecodeStreamBroken(f"no result for {request_id}", stream_lost=False)
            prompt_token_ids, params = decode_options_from_proto(item.options)
            decoder = self._decoders[request_id] = StopAwareDecoder.from_sampling_params(
                self._tokenizer, prompt_token_ids, params)
        step = decoder.update(list(item.token_ids), finished=item.finished,
                              stop_terminated=item.stop_terminated)
        result = pb.DecodeResult(request_id=request_id)
        fill_decode_result(result, step, item, self._token_strings)
        if step.finished:
            del self._decoders[request_id]
        return result

    def release(self, request_id: str) -> None:
        self._decoders.pop(request_id, None)

    async def close(self) -> None:
        self._decoders.clear()


def load_local_mux(info: pb.GetTokenizerInfoResponse) -> LocalDecodeMux | None:
    """A LocalDecodeMux over the tokenizer at `info.tokenizer_path`, or None when it is
    not offered, not readable here, or not the service's (another vocabulary size or
    fingerprint: pagoda.tokenizer.fingerprint).
    Blocking (seconds for a cold tokenizer): run it off the event loop."""
    path = info.tokenizer_path
    if not enabled() or not path or not os.path.exists(path):
        return None
    # lazy: transformers only in a gateway that decodes here
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
    # Same size is not the same tokenizer (another copy of the path, a model updated in
    # place): decode here only with the service's very tokenizer. A service that sends
    # no fingerprint (an older one) is not trusted with the path alone.
    mine = tokenizer_fingerprint(tokenizer)
    if mine != info.tokenizer_fingerprint:
        logger.warning("the tokenizer at %s here is not the tokenizer service's (fingerprint "
                       "%s, the service's %s): detokenizing on the tokenizer service", path,
                       mine[:12], info.tokenizer_fingerprint[:12] or "none")
        return None
    logger.info("detokenizing in the gateway's process (tokenizer at %s; %s=0 sends it to "
                "the tokenizer service)", path, ENV)
    return LocalDecodeMux(tokenizer)
