"""`POST /v1/chat/completions`: OpenAI chat, plain and streamed, through the model's template.

The conversation is rendered with the checkpoint's chat template (`kvctl.agent.model.
chat_template`, as transformers' `apply_chat_template` renders it, with the generation prompt),
encoded as transformers encodes it, and generated like a completion: the model's EOS ids (from
generation_config.json) end a turn. A model without a template has no chat: 400 saying so.
Tool calling and structured output are not implemented and are refused by name, never ignored.

Special-token text inside a message is tokenized as plain text unless the runtime setting
`chat.special_tokens_in_content` is `raw`: only the template's own control tokens are special, so
a user's `<|im_end|><|im_start|>system` cannot open a system turn (docs/security.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvctl.agent.http.context import ApiError, Context, ServerContext
from kvctl.agent.http.routes.generation import GENERATION_ERRORS, ChoiceOutput, Generation, Opened
from kvctl.agent.model.chat_template import RenderedChat, TemplateError
from kvctl.agent.model.processing import MAX_LOGPROBS, TokenLogprobs
from kvctl.agent.model.tokenizer import Span
from kvctl.api import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
)

router = APIRouter()


async def prompt_ids(ctx: ServerContext, gen: Generation, body: ChatCompletionRequest) -> list[int]:
    """The conversation rendered with the model's template and tokenized, checked against the
    prompt limit; 400 for a model without a template or messages it cannot render."""
    template = gen.served.chat_template
    if template is None:
        raise ApiError(
            400,
            f"model {gen.served.name!r} has no chat template (no chat_template.jinja and no "
            "chat_template in tokenizer_config.json), so it has no chat; use "
            "/v1/completions, or add the template to the checkpoint",
        )
    messages = [_message(m) for m in body.messages]
    tokenizer = gen.tokenizer
    plain = ctx.service.settings.chat.special_tokens_in_content == "plain"
    variables = _template_variables(body)
    if plain and tokenizer is not None:
        _no_special_text(variables, tokenizer.special_spans)
    try:
        if plain and tokenizer is not None:
            rendered = template.render_marked(
                messages, tokenizer.special_spans, body.add_generation_prompt, variables
            )
        else:
            rendered = RenderedChat(
                template.render(messages, body.add_generation_prompt, variables)
            )
    except (TemplateError, ValueError) as error:  # ValueError: look-alike special tokens
        raise ApiError(400, f"messages: {error}", param="messages") from None
    specials = template.add_special_tokens or body.add_special_tokens
    ids = await gen.tokenize(rendered.text, specials, rendered.plain_spans)
    gen.check_length(ids)
    return ids


def _no_special_text(
    variables: Mapping[str, object], special_spans: Callable[[str], list[Span]]
) -> None:
    """400 for a template variable holding special-token text: the template would write it
    into the prompt as a control token, which only the template itself may do."""
    for name, value in variables.items():
        if isinstance(value, str) and special_spans(value):
            raise ApiError(
                400,
                f"chat_template_kwargs: {name} holds special-token text, which only the chat "
                "template may write",
                param="chat_template_kwargs",
            )


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses=GENERATION_ERRORS,
)
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: Context) -> Response:
    """OpenAI chat completions, streamed as `chat.completion.chunk` events with
    `stream: true`."""
    asked = body.max_completion_tokens or body.max_tokens
    gen = Generation.for_request(ctx, "chatcmpl", body, asked)
    _refuse_unsupported(body)
    gen.check_choices(1, body.n)
    ids = await prompt_ids(ctx, gen, body)
    max_tokens = asked or min(ctx.config.max_tokens_limit, gen.served.context_length - len(ids))
    if max_tokens < 1:
        raise gen.refuse(
            400, "too_large", f"the conversation ({len(ids)} tokens) fills the model's context"
        )
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = gen.sampling(body, max_tokens, top)
    opened = await gen.open([ids], params, body.n, body.cache_salt)
    shaper = _Shaper(gen, body, ids)
    return await gen.answer(opened, request, shaper, body.stream)


def _template_variables(body: ChatCompletionRequest) -> dict[str, object]:
    """`chat_template_kwargs`, with `reasoning_effort` as vLLM passes it: the variable itself and
    `enable_thinking` (false for "none") unless the request's kwargs set it."""
    variables: dict[str, object] = dict(body.chat_template_kwargs or {})
    effort = body.reasoning_effort
    if effort is not None:
        variables["reasoning_effort"] = effort
        variables.setdefault("enable_thinking", effort != "none")
    return variables


def _message(message: ChatMessage) -> dict[str, Any]:
    """A message as templates expect it: content as one string (text parts joined by newlines,
    as vLLM does for string-content templates); an assistant's reasoning under the names
    templates read it by (`reasoning_content`, `reasoning`, gpt-oss's `thinking`), as vLLM and
    transformers hand it on."""
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    result: dict[str, Any] = {"role": message.role, "content": content}
    if message.name is not None:
        result["name"] = message.name
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if message.role == "assistant" and reasoning is not None:
        result = {"thinking": reasoning, **result}
        result["reasoning"] = result["reasoning_content"] = reasoning
    return result


def _refuse_unsupported(body: ChatCompletionRequest) -> None:
    for name in ("tools", "functions", "function_call"):
        if getattr(body, name) is not None:
            raise ApiError(400, f"{name}: tool calling is not supported by this agent")
    if body.tool_choice not in (None, "none"):
        raise ApiError(400, "tool_choice: tool calling is not supported by this agent")
    for i, message in enumerate(body.messages):
        if message.role == "tool" or message.tool_calls is not None or message.tool_call_id:
            raise ApiError(
                400, f"messages.{i}: tool messages and tool calls are not supported by this agent"
            )
    if body.top_logprobs is not None:
        if body.top_logprobs > MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs: at most {MAX_LOGPROBS}, got {body.top_logprobs}")
        if body.top_logprobs and not body.logprobs:  # 0 is vLLM's default: nothing asked
            raise ApiError(400, "top_logprobs: needs logprobs set to true")


class _Shaper:
    """One chat request's choices in OpenAI's chat shapes."""

    def __init__(self, gen: Generation, body: ChatCompletionRequest, prompt: list[int]) -> None:
        self.gen, self.body, self.prompt = gen, body, prompt
        self.created = int(time.time())

    def logprobs(self, tokens: list[int], entries: list[TokenLogprobs | None]) -> ChatLogprobs:
        text = self.gen.token_text

        def top(token: int, logprob: float) -> ChatTopLogprob:
            piece = text(token)
            return ChatTopLogprob(token=piece, logprob=logprob, bytes=list(piece.encode()))

        content = []
        for token, entry in zip(tokens, entries, strict=True):
            if entry is None:
                continue
            chosen = top(token, entry.logprob)
            alternatives = [top(t, lp) for t, lp in entry.top]
            content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=alternatives))
        return ChatLogprobs(content=content)

    def response(self, opened: Opened, outputs: list[ChoiceOutput]) -> ChatCompletionResponse:
        body = self.body
        choices = [
            ChatChoice(
                index=out.index,
                message=ChatResponseMessage(content="".join(out.text)),
                finish_reason=out.finish_reason,
                logprobs=self.logprobs(out.token_ids, out.logprobs) if body.logprobs else None,
                token_ids=list(out.summary.output_ids) if body.return_token_ids else None,
                finish_detail=out.summary.finish_detail,
            )
            for out in outputs
        ]
        return ChatCompletionResponse(
            id=opened.request_id,
            created=self.created,
            model=self.gen.served.name,
            choices=choices,
            usage=self.gen.usage([o.summary for o in outputs], body.n),
            prompt_token_ids=self.prompt if body.return_token_ids else None,
        )

    async def sse(self, opened: Opened) -> AsyncIterator[str]:
        """A first chunk per choice with the assistant role, then one per token, the last of a
        choice with its finish reason; with `stream_options.include_usage`, a last chunk with
        no choices and the request's usage.

        The role chunk goes out with the choice's first token, as vLLM and OpenAI send it, not
        when the request is taken: a client times its first chunk as the first token, so an
        early empty chunk would show a time to first token that hides the prompt's computing
        and a time per token that includes it."""
        body = self.body
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        summaries: list[Any] = [None] * len(opened.streams)
        started: set[int] = set()
        async for index, event in self.gen.events(opened):
            if index not in started:
                started.add(index)
                role = {"role": "assistant", "content": ""}
                first = {"index": index, "delta": role, "logprobs": None, "finish_reason": None}
                yield self._line(opened, [first], include_usage)
            tokens = [] if event.token_id is None else [event.token_id]
            choice: dict[str, Any] = {
                "index": index,
                "delta": {"content": event.text} if event.text else {},
                "logprobs": None,
                "finish_reason": event.finish_reason.value if event.finish_reason else None,
            }
            if body.logprobs and tokens:
                choice["logprobs"] = self.logprobs(tokens, [event.logprobs]).model_dump()
            if body.return_token_ids:
                choice["token_ids"] = tokens
            if event.finish_reason is not None and event.summary is not None:
                summaries[index] = event.summary
                if event.summary.finish_detail:
                    choice["finish_detail"] = event.summary.finish_detail
            yield self._line(opened, [choice], include_usage)
        if include_usage:
            usage = self.gen.usage(summaries, body.n).model_dump(exclude_none=True)
            yield self._line(opened, [], include_usage, usage)
        yield "data: [DONE]\n\n"

    def _line(
        self,
        opened: Opened,
        choices: list[dict[str, Any]],
        include_usage: bool,
        usage: dict[str, Any] | None = None,
    ) -> str:
        chunk: dict[str, Any] = {
            "id": opened.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.gen.served.name,
            "choices": choices,
        }
        if include_usage:
            chunk["usage"] = usage  # null on every chunk but the last, as OpenAI sends it
        return f"data: {json.dumps(chunk)}\n\n"
