"""The tokenizer service's RPCs over one HF tokenizer."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import grpc

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from pagoda.config import DEFAULT_PREFIX_HASH_SEED
from pagoda.core.block_hash import (DEFAULT_HASH_ALGO, check_hash_algo, hash_request_tokens,
                                     request_keys)
from pagoda.multimodal.chat_render import placeholder_texts, render_media_chat
from pagoda.services.common.protocol.common import json_object_from_proto
from pagoda.services.common.protocol.decode_results import TokenStrings, fill_decode_result
from pagoda.services.common.protocol.multimodal import features_to_proto
from pagoda.services.common.protocol.sampling_params import decode_options_from_proto
from pagoda.services.common.protocol.tokenizer import chat_input_from_proto
from pagoda.services.tokenizer.metrics import timed, tokenizer_metrics
from pagoda.tokenizer.chat import render_chat_template
from pagoda.tokenizer import harmony
from pagoda.tokenizer.template_sandbox import TemplateLimits, template_limits
from pagoda.tokenizer.fingerprint import tokenizer_fingerprint
from pagoda.tokenizer.stop_aware_decoder import StopAwareDecoder

logger = logging.getLogger(__name__)


class TokenizerServicer(pb_grpc.TokenizerServiceServicer):
    """Stateless except for each live DecodeStream's decoders, which die with it."""

    # Chat templates render within these (--chat-template-render-timeout and
    # --chat-template-max-output-chars; None: the sandbox's defaults).
    template_limits: TemplateLimits | None = None
    # The cluster's processor for chats with media (media_prompt.MediaPreprocessor;
    # None: media are refused).
    media = None
    # Chats are rendered in gpt-oss's harmony format, not with a chat template (vLLM's
    # rule for gpt-oss; `pagoda.tokenizer.harmony`).
    harmony = False
    # The local path the tokenizer was loaded from, offered to gateways that can read it
    # (GetTokenizerInfo.tokenizer_path: they detokenize in their own process); "" offers
    # none (a servicer built around a tokenizer object).
    tokenizer_path = ""
    _tokenizer_fingerprint: str | None = None

    def __init__(self, tokenizer: Any, model: str, eos_token_ids: list[int],
                 prefix_hash_seed: str = DEFAULT_PREFIX_HASH_SEED,
                 prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.prefix_hash_seed = prefix_hash_seed
        self.prefix_caching_hash_algo = check_hash_algo(prefix_caching_hash_algo)
        self.vocab_size = len(tokenizer)
        # id -> decode([id]); a pure function of the id, so it is cached for good
        # (bounded by the vocabulary). Logprobs ask for the same few ids again and again.
        self.decode_tokens = TokenStrings(tokenizer)  # logprob token strings, cached

    @timed("Tokenize")
    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext
                 ) -> pb.TokenizeResponse:
        """Encode the prompt (a prompt given as ids is taken as is), then hash its
        blocks if asked: the same function, seed and salt keys as the schedulers'
        (`pagoda.core.block_hash`), which the gateway checks at start-up."""
        if request.block_size < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"block_size must not be negative, got {request.block_size}")
        features: list = []
        try:
            if request.WhichOneof("input") == "chat" and request.chat.media:
                prompt, token_ids, features = self._encode_with_media(request)
                token_type_ids = []
            else:
                prompt, token_ids, token_type_ids = self._encode(request)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # a template's own errors (jinja2) are the caller's input
            what = "media processing error" if features or request.chat.media else \
                "chat template error"
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {exc}")
        response = pb.TokenizeResponse(token_ids=token_ids, prompt=prompt,
                                       token_type_ids=token_type_ids)
        if self.harmony and request.WhichOneof("input") == "chat":
            response.chat_stop_token_ids.extend(harmony.stop_token_ids(self.tokenizer))
        features_to_proto(features, response.mm_features)
        if request.block_size > 0:  # a block a media run overlaps is keyed by its identifier
            response.block_hashes.extend(hash_request_tokens(
                token_ids, request.block_size, self.prefix_hash_seed,
                request_keys(request.cache_salt, request.lora_key),
                algo=self.prefix_caching_hash_algo, mm_features=features))
        if request.return_token_strs:
            response.token_strs.extend(self.tokenizer.convert_ids_to_tokens(token_ids))
        return response

    def _encode_with_media(self, request: pb.TokenizeRequest) -> tuple[str, list[int], list]:
        """A chat with media: render, then load the media and run the model's processor
        (`media_prompt`): (the rendered text, the expanded ids, the features)."""
        if self.media is None:
            raise ValueError(f"Model {self.model!r} does not accept multi-modal data (images): "
                             "this tokenizer service has no processor for it.")
        chat = request.chat
        rendering = chat_input_from_proto(chat)
        with template_limits(self.template_limits):
            prompt = render_media_chat(self.tokenizer, rendering.pop("messages"),
                                       placeholder_texts(self.media.processor), **rendering)
        kwargs = (json_object_from_proto(chat.mm_processor_kwargs)
                  if chat.HasField("mm_processor_kwargs") else None)
        processed = self.media.process(prompt, chat.media, kwargs, request.add_special_tokens)
        tokenizer_metrics().tokens_of["Tokenize"].inc(len(processed.prompt_token_ids))
        return prompt, processed.prompt_token_ids, processed.mm_features

    def _encode(self, request: pb.TokenizeRequest) -> tuple[str, list[int], list[int]]:
        """(the text encoded, its token ids, a text pair's token types); ValueError for
        invalid chat input."""
        kind = request.WhichOneof("input")
        token_type_ids: list[int] = []
        if kind == "token_ids":
            return "", list(request.token_ids.token_ids), []  # nothing to encode
        if kind == "chat" and self.harmony:
            prompt, token_ids = self._encode_harmony(request)
        elif kind == "chat":
            with template_limits(self.template_limits):
                prompt = render_chat_template(self.tokenizer,
                                              **chat_input_from_proto(request.chat))
            # vLLM's chat add_special_tokens (off by default): on top of the template's.
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
        elif request.truncate_left and request.max_length > 0 and not request.HasField("text_pair"):
            prompt = request.prompt
            token_ids = _truncated_left(self.tokenizer, prompt, request.max_length,
                                        request.add_special_tokens)
        elif request.HasField("text_pair") or request.max_length > 0:
            prompt = request.prompt
            pair = request.text_pair if request.HasField("text_pair") else None
            encoded = self.tokenizer(prompt, pair, add_special_tokens=request.add_special_tokens,
                                     truncation=request.max_length > 0,
                                     max_length=request.max_length or None)
            token_ids = encoded["input_ids"]
            if pair is not None:
                token_type_ids = list(encoded.get("token_type_ids") or [])
        else:
            prompt = request.prompt
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
        tokenizer_metrics().tokens_of["Tokenize"].inc(len(token_ids))
        return prompt, token_ids, token_type_ids

    def _encode_harmony(self, request: pb.TokenizeRequest) -> tuple[str, list[int]]:
        """A gpt-oss chat: (its harmony text, its ids). The request's reasoning_effort
        travels in chat_template_kwargs. As in vLLM, add_special_tokens does not apply
        (the harmony prompt is complete as rendered)."""
        chat = chat_input_from_proto(request.chat)
        segments = harmony.harmony_segments(
            chat["messages"], chat["tools"],
            harmony.effort_from_kwargs(chat["chat_template_kwargs"]),
            chat["add_generation_prompt"], chat["continue_final_message"])
        token_ids = harmony.encode_harmony(self.tokenizer, segments)
        prompt = harmony.segments_text(segments)
        return prompt, token_ids

    @timed("Detokenize")
    def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.ServicerContext
                   ) -> pb.DetokenizeResponse:
        bad = [t for t in request.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"Token id {bad[0]} is out of vocabulary (vocab size {self.vocab_size}).")
        text = self.tokenizer.decode(list(request.token_ids),
                                     skip_special_tokens=request.skip_special_tokens)
        return pb.DetokenizeResponse(text=text)

    def DecodeStream(self, request_iterator: Iterator[pb.DecodeStreamRequest],
                     context: grpc.ServicerContext) -> Iterator[pb.DecodeStreamResponse]:
        decoders: dict[str, StopAwareDecoder] = {}
        metrics = tokenizer_metrics()
        tokens = metrics.tokens_of["DecodeStream"]
        for request in request_iterator:
            response = pb.DecodeStreamResponse()
            with metrics.time("DecodeStream"):
                # Results are built in place (`add()`): a message built first and then
                # appended is copied, which cost more than decoding its token.
                add = response.results.add
                num_tokens = 0
                for item in request.inputs:
                    num_tokens += self._decode_one(decoders, item, add)
            tokens.inc(num_tokens)
            yield response

    def GetTokenizerInfo(self, request: pb.GetTokenizerInfoRequest, context: grpc.ServicerContext
                         ) -> pb.GetTokenizerInfoResponse:
        return pb.GetTokenizerInfoResponse(
            model=self.model, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids,
            has_chat_template=self.harmony or
            getattr(self.tokenizer, "chat_template", None) is not None,
            prefix_hash_seed=self.prefix_hash_seed,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            tokenizer_path=self.tokenizer_path,
            tokenizer_fingerprint=self._fingerprint() if self.tokenizer_path else "")

    def _fingerprint(self) -> str:
        """The loaded tokenizer's fingerprint, computed once (tens of ms: a fast
        tokenizer's JSON), only when a path is offered."""
        if self._tokenizer_fingerprint is None:
            self._tokenizer_fingerprint = tokenizer_fingerprint(self.tokenizer)
        return self._tokenizer_fingerprint

    def _decode_one(self, decoders: dict[str, StopAwareDecoder], item: pb.DecodeInput,
                    add) -> int:
        """One completion's input -> its result (`add()` makes it in the response; none
        for a release or an input of a completion already complete), through the
        library's `StopAwareDecoder` (the one the offline engine uses): the stream only
        keeps them by request id. Returns the input's token count (the metric's)."""
        request_id = item.request_id
        if item.release:
            decoders.pop(request_id, None)
            return len(item.token_ids)
        decoder = decoders.get(request_id)
        if decoder is None:
            if not item.HasField("options"):  # a completion already complete: ignore
                return len(item.token_ids)
            decoder = decoders[request_id] = self._new_decoder(item.options)
        token_ids = list(item.token_ids)
        step = decoder.update(token_ids, finished=item.finished,
                              stop_terminated=item.stop_terminated)
        fill_decode_result(add(request_id=request_id), step, item, self.decode_tokens)
        if step.finished:
            del decoders[request_id]
        return len(token_ids)

    def _new_decoder(self, options: pb.DecodeOptions) -> StopAwareDecoder:
        prompt_token_ids, params = decode_options_from_proto(options)
        return StopAwareDecoder.from_sampling_params(self.tokenizer, prompt_token_ids, params)


def _truncated_left(tokenizer, text: str, max_length: int, add_special_tokens: bool) -> list[int]:
    """`text`'s last tokens, at most `max_length` with the special tokens the tokenizer
    puts around them (kept, as the tokenizer's own left-side truncation keeps them)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.encode(text, add_special_tokens=True) if add_special_tokens else ids
    # The special tokens are what surrounds the text's own ids in the full encoding.
    start = next((k for k in range(len(full) - len(ids) + 1)
                  if full[k:k + len(ids)] == ids), 0)
    prefix, suffix = full[:start], full[start + len(ids):]
    room = max(max_length - len(prefix) - len(suffix), 0)
    return prefix + (ids[len(ids) - room:] if room else []) + suffix
