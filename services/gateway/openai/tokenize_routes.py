"""vLLM's POST /tokenize and /detokenize: a prompt or chat messages to token ids through
the tokenizer service, and token ids back to text.

/tokenize renders chat messages exactly as /v1/chat/completions does (same checks, same
template input), so its count is the prompt length a chat request would have; the answer
carries the served model's `max_model_len` beside it. Both check the model name first
(404 for an unknown one) and answer a tokenizer failure in OpenAI's error JSON.
"""

from __future__ import annotations

import grpc
from fastapi import APIRouter, Request

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.gateway.errors import from_grpc_error
from pagoda.services.gateway.openai import routes as openai_routes
from pagoda.services.gateway.openai.request_models import (DetokenizeRequest, TokenizeChatRequest,
                                                           TokenizeCompletionRequest)
from pagoda.services.gateway.state import GatewayState

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeChatRequest | TokenizeCompletionRequest,
                   request: Request) -> dict:
    state: GatewayState = request.app.state.gateway
    state.check_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        openai_routes.check_chat_request(state, body)
        _, chat = openai_routes.chat_input(body.messages, body.add_generation_prompt,
                                           body.continue_final_message,
                                           body.chat_template_kwargs)
        tokenize_request = tpb.TokenizeRequest(chat=chat,
                                               return_token_strs=body.return_token_strs)
    else:
        tokenize_request = tpb.TokenizeRequest(prompt=body.prompt,
                                               add_special_tokens=body.add_special_tokens,
                                               return_token_strs=body.return_token_strs)
    reply = await openai_routes.tokenize(state, tokenize_request)
    result = {"count": len(reply.token_ids), "max_model_len": state.peers.model_info()
              .max_model_len, "tokens": list(reply.token_ids)}
    if body.return_token_strs:
        result["token_strs"] = list(reply.token_strs)
    return result


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state: GatewayState = request.app.state.gateway
    state.check_model(body.model)
    state.peers.tokenizer_info()
    try:
        reply = await state.peers.tokenizer.stub.Detokenize(
            tpb.DetokenizeRequest(token_ids=body.tokens, skip_special_tokens=False),
            timeout=60.0)
    except grpc.RpcError as exc:
        raise from_grpc_error(exc, "tokenizer") from None
    return {"prompt": reply.text}
