"""The pooling endpoints: /v1/embeddings, /pooling, /classify, /score, /rerank.

Response shapes are vLLM's (OpenAI's for embeddings). An embedding travels as floats
or, with `encoding_format: "base64"`, as the base64 of its little-endian float32
bytes (what the openai client asks for by default and decodes). /score and /rerank
score pairs with a cross-encoder (a one-label classifier reads each pair as one
prompt), on an embedding model by the cosine similarity of the two embeddings, or on
a late-interaction model (ColBERT) by the MaxSim of the two texts' token embeddings.
"""

from __future__ import annotations

import base64
import struct
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pagoda.pooling_params import TOKEN_TASKS, PoolingParams
from pagoda.score_utils import cosine_similarity, maxsim, score_pairs
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.openai.completion_bodies import Usage
from pagoda.services.gateway.openai.routes import until_disconnected
from pagoda.services.gateway.pooling.fan_out import (Pooling, PooledResult, pooling_model,
                                                     requested_task, response_id, tokenize_inputs,
                                                     tokenize_pairs)
from pagoda.services.gateway.pooling.request_models import (ClassificationRequest, EmbeddingRequest,
                                                            PoolingRequest, RerankRequest,
                                                            ScoreRequest)
from pagoda.services.gateway.state import GatewayState

router = APIRouter()


def encode_vector(data: list[float], encoding_format: str) -> list[float] | str:
    """floats as they are, or base64 of little-endian float32 (OpenAI's base64 form)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(data)}f", *data)).decode("ascii")
    return data


def _list_body(rid: str, model: str, data: list[dict], usage: Usage) -> JSONResponse:
    return JSONResponse({"id": rid, "object": "list", "created": int(time.time()),
                         "model": model, "data": data, "usage": usage.as_dict()})


async def _run(state: GatewayState, request: Request, prefix: str, inputs, params,
               user: str | None) -> tuple[str, list[PooledResult], Usage]:
    rid, unique = response_id(request, prefix)
    run = Pooling(state.peers, rid, inputs, params, user, unique)
    return rid, await until_disconnected(run.results(), request), run.usage


@router.post("/v1/embeddings")
async def create_embedding(body: EmbeddingRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    model = state.check_model(body.model, allow_lora=False)
    pooling_model(state, "embed")
    inputs = await tokenize_inputs(state, body.input, body.truncate_prompt_tokens,
                                   body.add_special_tokens)
    rid, results, usage = await _run(state, request, "embd", inputs, body.pooling_params(),
                                     body.user)
    return _list_body(rid, model, [{"index": r.index, "object": "embedding",
                                    "embedding": encode_vector(r.data, body.encoding_format)}
                                   for r in results], usage)


@router.post("/pooling")
async def create_pooling(body: PoolingRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    model = state.check_model(body.model, allow_lora=False)
    task = requested_task(pooling_model(state, "encode"), body.task)
    inputs = await tokenize_inputs(state, body.input, body.truncate_prompt_tokens,
                                   body.add_special_tokens)
    rid, results, usage = await _run(state, request, "pool", inputs, body.pooling_params(),
                                     body.user)
    data = []
    for r in results:
        vector = encode_vector(r.data, body.encoding_format)
        if task in ("token_embed", *TOKEN_TASKS) and body.encoding_format == "float":
            # one row per prompt token (vLLM's 2-D `data`), flattened token-major on the wire
            dim = len(r.data) // len(inputs[r.index].token_ids)
            vector = [r.data[i:i + dim] for i in range(0, len(r.data), dim)]
        data.append({"index": r.index, "object": "pooling", "data": vector})
    return _list_body(rid, model, data, usage)


@router.post("/classify")
async def create_classify(body: ClassificationRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    model = state.check_model(body.model, allow_lora=False)
    labels = list(pooling_model(state, "classify").labels)
    inputs = await tokenize_inputs(state, body.input, body.truncate_prompt_tokens,
                                   body.add_special_tokens)
    rid, results, usage = await _run(state, request, "classify", inputs, body.pooling_params(),
                                     body.user)
    data = []
    for r in results:
        best = max(range(len(r.data)), key=r.data.__getitem__)
        data.append({"index": r.index, "label": labels[best] if best < len(labels) else None,
                     "probs": r.data, "num_classes": len(r.data)})
    return _list_body(rid, model, data, usage)


async def _scores(state: GatewayState, request: Request, prefix: str, left: list[str],
                  right: list[str], truncate: int | None, use_activation: bool | None,
                  user: str | None) -> tuple[str, list[float], Usage]:
    """The score of each pair (left[i], right[i]): a cross-encoder's, the cosine
    similarity of an embedding model's embeddings, or the MaxSim of a late-interaction
    model's token embeddings (each distinct text embedded once)."""
    task = pooling_model(state, "score").task
    if task == "classify":
        inputs = await tokenize_pairs(state, left, right, truncate)
        rid, results, usage = await _run(state, request, prefix, inputs,
                                         PoolingParams(task="score", use_activation=use_activation),
                                         user)
        return rid, [r.data[0] for r in results], usage
    if use_activation is not None:
        raise APIError("use_activation applies to cross-encoders; this model scores by "
                       "embedding similarity.", param="use_activation")
    texts = list(dict.fromkeys(left + right))
    inputs = await tokenize_inputs(state, texts, truncate)
    rid, results, usage = await _run(state, request, prefix, inputs,
                                     PoolingParams(task="token_embed" if task == "token_embed"
                                                   else "embed"), user)
    vectors = {text: r.data for text, r in zip(texts, results)}
    if task == "token_embed":  # one embedding per token: the size is what each token got
        dim = len(results[0].data) // len(inputs[0].token_ids)
        return rid, [maxsim(vectors[a], vectors[b], dim) for a, b in zip(left, right)], usage
    return rid, [cosine_similarity(vectors[a], vectors[b]) for a, b in zip(left, right)], usage


@router.post("/score")
@router.post("/v1/score")
async def create_score(body: ScoreRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    model = state.check_model(body.model, allow_lora=False)
    try:
        left, right = score_pairs(body.text_1, body.text_2)
    except ValueError as exc:
        raise APIError(str(exc), param="text_1") from None
    rid, scores, usage = await _scores(state, request, "score", left, right,
                                       body.truncate_prompt_tokens, body.use_activation, body.user)
    return _list_body(rid, model, [{"index": i, "object": "score", "score": s}
                                   for i, s in enumerate(scores)], usage)


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def create_rerank(body: RerankRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    model = state.check_model(body.model, allow_lora=False)
    if not body.documents:
        raise APIError("The documents cannot be empty.", param="documents")
    rid, scores, usage = await _scores(state, request, "rerank", [body.query] * len(body.documents),
                                       body.documents, body.truncate_prompt_tokens,
                                       body.use_activation, body.user)
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if body.top_n:
        order = order[:body.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": body.documents[i]}
        results.append(result)
    return JSONResponse({"id": rid, "model": model, "usage": {"total_tokens": usage.prompt_tokens},
                         "results": results})
