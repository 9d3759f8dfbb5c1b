"""`POST /v1/tokenize`: texts counted in the served model's tokens.

A client that sizes prompts in tokens (`kvctl load`) may run on another host than the agent and
should not need the model's files or torch: it asks the agent, which counts exactly as
/v1/completions does (`usage.prompt_tokens`). Tokenizing runs on a worker thread, one call at a
time, so the engine thread and other requests never wait on it; the body limit bounds the work.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from kvctl.agent.http_context import ApiError, Context
from kvctl.agent.service import UnknownPool
from kvctl.api import TokenizedText, TokenizeRequest, TokenizeResponse

router = APIRouter()


@router.post("/v1/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, ctx: Context) -> TokenizeResponse:
    """Token ids and counts of one text or a batch, in the order given."""
    try:
        pool = ctx.service.pool(body.model)
    except UnknownPool as unknown:
        message = str(unknown) if body.model else f"{unknown}; give `model`"
        kind = "model_not_found" if body.model else "model_required"
        raise ApiError(404 if body.model else 400, message, error_type=kind) from None
    served, tokenizer = pool.served, pool.engine.tokenizer
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer (no tokenizer.json): nothing to count")
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt

    def encode_all() -> list[list[int]]:
        return [tokenizer.encode(t, add_special_tokens=body.add_special_tokens) for t in texts]

    async with ctx.tokenizing("tokenize"):
        encoded = await asyncio.to_thread(encode_all)
    results = [
        TokenizedText(count=len(ids), tokens=ids if body.return_token_ids else None)
        for ids in encoded
    ]
    return TokenizeResponse(model=served.name, max_model_len=served.context_length, results=results)
