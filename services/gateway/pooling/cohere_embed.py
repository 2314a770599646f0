"""Cohere's embed API, `POST /v2/embed`, as vLLM serves it (the Cohere SDK's `embed`).

    texts + input_type ─► the model's prefix for that input_type before each text
      ─► truncate: END (default) / START keep the first / last `max_tokens` tokens
         (the context length when unset); NONE truncates nothing, and with
         `max_tokens` refuses a longer text
      ─► one embedding per text (`output_dimension`: matryoshka)
      ─► `embeddings` by type: float, binary / ubinary (the signs packed 8 per byte,
         signed / unsigned), base64 (little-endian float32)

An `input_type` is accepted only when the model defines prefixes (config.json's
`task_instructions`, or config_sentence_transformers.json's `prompts`), as in vLLM.
Images (`images`, or image parts of `inputs`) are refused: the served models embed text.
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pagoda.pooling_params import PoolingParams
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.openai.routes import until_disconnected
from pagoda.services.gateway.pooling.fan_out import (Pooling, pooling_model, response_id,
                                                     tokenize_inputs)
from pagoda.services.gateway.state import GatewayState

router = APIRouter()

INT32_MAX = 2**31 - 1
EmbeddingType = Literal["float", "binary", "ubinary", "base64"]  # vLLM's set


class CohereEmbedContent(BaseModel):
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: dict[str, str] | None = None


class CohereEmbedInput(BaseModel):
    content: list[CohereEmbedContent]


class CohereEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    input_type: str | None = None
    texts: list[str] | None = None
    images: list[str] | None = None
    inputs: list[CohereEmbedInput] | None = None
    output_dimension: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    embedding_types: list[EmbeddingType] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    priority: int = 0


def pack_signs(vector: list[float], signed: bool) -> list[int]:
    """Cohere's binary embeddings: bit 1 for a value >= 0, 8 per byte, first value in
    the high bit; `signed` shifts each byte by -128 (int8)."""
    if len(vector) % 8:
        raise APIError("Embedding dimension must be a multiple of 8 for binary embedding "
                       f"types, but got {len(vector)}.", param="embedding_types")
    out = []
    for i in range(0, len(vector), 8):
        byte = sum((1 << (7 - j)) for j, v in enumerate(vector[i:i + 8]) if v >= 0)
        out.append(byte - 128 if signed else byte)
    return out


def typed_embeddings(vectors: list[list[float]], types: list[str]) -> dict[str, list]:
    """`embeddings` of the response: one list per requested type, vectors in order."""
    out: dict[str, list] = {}
    for kind in dict.fromkeys(types):
        if kind == "float":
            out[kind] = vectors
        elif kind in ("binary", "ubinary"):
            out[kind] = [pack_signs(v, signed=kind == "binary") for v in vectors]
        else:
            out[kind] = [base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii")
                         for v in vectors]
    return out


def _texts(body: CohereEmbedRequest, prompts: dict[str, str]) -> list[str]:
    """The texts to embed, each after its input_type's prefix; 400s naming the field."""
    if body.images is not None:
        raise APIError("images are not supported: the served model embeds text.",
                       param="images")
    if body.inputs is not None:
        raise APIError("inputs (mixed text and image content) are not supported: the served "
                       "model embeds text; send texts.", param="inputs")
    if body.texts is None:
        raise APIError("One of texts, images, or inputs must be provided.", param="texts")
    if not body.texts:
        raise APIError("texts cannot be empty.", param="texts")
    if body.input_type is None:
        return list(body.texts)
    if not prompts:
        raise APIError(f"Unsupported input_type {body.input_type!r}. This model does not "
                       "define any input_type prompt prefixes.", param="input_type")
    if body.input_type not in prompts:
        raise APIError(f"Unsupported input_type {body.input_type!r}. Supported values: "
                       f"{', '.join(sorted(prompts))}", param="input_type")
    return [prompts[body.input_type] + text for text in body.texts]


@router.post("/v2/embed")
async def create_cohere_embed(body: CohereEmbedRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    state.check_model(body.model, allow_lora=False)
    pooling = pooling_model(state, "embed")
    texts = _texts(body, dict(pooling.prompts))
    max_model_len = state.peers.model_info().max_model_len
    if body.max_tokens is not None and body.max_tokens > max_model_len:
        raise APIError(f"max_tokens ({body.max_tokens}) is greater than max_model_len "
                       f"({max_model_len}).", param="max_tokens")
    truncate = None if body.truncate == "NONE" else (body.max_tokens or -1)
    inputs = await tokenize_inputs(state, texts, truncate,
                                   truncate_left=body.truncate == "START")
    if body.truncate == "NONE" and body.max_tokens is not None:
        for item in inputs:
            if len(item.token_ids) > body.max_tokens:
                raise APIError(f"Input of {len(item.token_ids)} tokens exceeds max_tokens="
                               f"{body.max_tokens} with truncate=NONE. Set truncate to END "
                               "or START to allow truncation.", param="max_tokens")
    rid, unique = response_id(request, "embd")
    run = Pooling(state.peers, rid, inputs,
                  PoolingParams(task="embed", dimensions=body.output_dimension), None, unique)
    results = await until_disconnected(run.results(), request)
    vectors = [r.data for r in results]
    response = {"id": rid, "embeddings": typed_embeddings(vectors, body.embedding_types
                                                          or ["float"])}
    if body.texts is not None:
        response["texts"] = list(body.texts)
    response["meta"] = {"api_version": {"version": "2"},
                        "tokens": {"input_tokens": run.usage.prompt_tokens}}
    return JSONResponse(response)
