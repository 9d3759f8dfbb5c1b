"""`POST /v1/tokenize`: texts counted in the served model's tokens.

A client that sizes prompts in tokens (`kvctl load`) may run on another host than the agent and
should not need the model's files or torch: it asks the agent, which counts exactly as
/v1/completions does (`usage.prompt_tokens`). Each text is bounded as a completions prompt is (a
text longer than 16 bytes per token of the prompt limit is refused before anything is tokenized)
and tokenized on the same worker, under the same lock, one text at a time, so a large batch
takes its turn with the other routes' prompts, one text at a time.
"""

from __future__ import annotations

from fastapi import APIRouter

from kvctl.agent.generation import encode, oversized, prompt_limit
from kvctl.agent.http.context import ApiError, Context
from kvctl.agent.service import UnknownPool
from kvctl.api import TokenizedText, TokenizeRequest, TokenizeResponse

router = APIRouter()


@router.post("/v1/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, ctx: Context) -> TokenizeResponse:
    """Token ids and counts of one text or a batch, in the order given; 400 naming the limit
    for a text too long to be a prompt, before any text is tokenized."""
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
    limit = prompt_limit(ctx.config, served)
    for i, text in enumerate(texts):
        refusal = oversized(text, limit)
        if refusal is not None:
            param = "prompt" if isinstance(body.prompt, str) else f"prompt.{i}"
            raise ApiError(400, f"{param}: {refusal}", param=param)
    encoded = [await encode(ctx.tokenizing, tokenizer, t, body.add_special_tokens) for t in texts]
    results = [
        TokenizedText(count=len(ids), tokens=ids if body.return_token_ids else None)
        for ids in encoded
    ]
    return TokenizeResponse(model=served.name, max_model_len=served.context_length, results=results)
