"""OpenAI's `/v1/embeddings`: each input's last hidden states, mean-pooled, from the engine's
embedding request (a prefill that samples nothing)."""

from __future__ import annotations

import asyncio
import base64
import uuid

import numpy as np
from fastapi import APIRouter, Request

from engram.server.auth import caller_of
from engram.server.errors import APIError
from engram.server.protocol import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from engram.server.serving import engine_request_id, get_serving
from engram.server.streaming import cancel_on_disconnect

router = APIRouter()


@router.post("/v1/embeddings")
@cancel_on_disconnect
async def embeddings(request: EmbeddingRequest, raw_request: Request) -> EmbeddingResponse:
    s = get_serving(raw_request)
    s.check_model(request.model)
    size = s.engine.engine.spec.hidden_size
    if request.dimensions not in (None, size):
        raise APIError(400, f"dimensions: this model's embeddings have {size}; they are not truncated", param="dimensions")
    prompts = [await s.encode_prompt(text) for text in request.inputs]
    rid = engine_request_id(caller_of(raw_request).tenant, f"embd-{uuid.uuid4().hex}")
    embeds = [asyncio.ensure_future(s.embed(f"{rid}-{i}", ids)) for i, ids in enumerate(prompts)]
    try:
        vectors = await asyncio.gather(*embeds)
    finally:  # one that failed (or a client gone) ends the others
        for embed in embeds:
            embed.cancel()
    data = [Embedding(index=i, embedding=_encoded(v, request.encoding_format)) for i, v in enumerate(vectors)]
    tokens = sum(map(len, prompts))
    return EmbeddingResponse(data=data, model=s.model_name, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64: the little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
