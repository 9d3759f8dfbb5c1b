"""A chat conversation as a model's prompt: rendered with the checkpoint's chat template (as
transformers' `apply_chat_template` renders it, with the generation prompt), encoded as
transformers encodes it, and checked against the prompt limit. The chat route and the prefix
routes (a lookup or pin of a conversation) read a conversation the same way.

Special-token text inside a message is tokenized as plain text unless the runtime setting
`chat.special_tokens_in_content` is `raw`: only the template's own control tokens are special, so
a user's `<|im_end|><|im_start|>system` cannot open a system turn (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvctl.agent.generation import Generation, Refusal
from kvctl.agent.model.chat_template import RenderedChat, TemplateError
from kvctl.agent.model.tokenizer import Span
from kvctl.api import ChatCompletionRequest, ChatMessage


async def prompt_ids(gen: Generation, body: ChatCompletionRequest) -> list[int]:
    """The conversation rendered with the model's template and tokenized, checked against the
    prompt limit; 400 for a model without a template or messages it cannot render."""
    template = gen.served.chat_template
    if template is None:
        raise Refusal(
            400,
            f"model {gen.served.name!r} has no chat template (no chat_template.jinja and no "
            "chat_template in tokenizer_config.json), so it has no chat; use "
            "/v1/completions, or add the template to the checkpoint",
        )
    messages = [as_template_message(m) for m in body.messages]
    tokenizer = gen.tokenizer
    plain = gen.service.settings.chat.special_tokens_in_content == "plain"
    variables = template_variables(body)
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
        raise Refusal(400, f"messages: {error}", param="messages") from None
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
            raise Refusal(
                400,
                f"chat_template_kwargs: {name} holds special-token text, which only the chat "
                "template may write",
                param="chat_template_kwargs",
            )


def template_variables(body: ChatCompletionRequest) -> dict[str, object]:
    """`chat_template_kwargs`, with `reasoning_effort` as vLLM passes it: the variable itself and
    `enable_thinking` (false for "none") unless the request's kwargs set it."""
    variables: dict[str, object] = dict(body.chat_template_kwargs or {})
    effort = body.reasoning_effort
    if effort is not None:
        variables["reasoning_effort"] = effort
        variables.setdefault("enable_thinking", effort != "none")
    return variables


def as_template_message(message: ChatMessage) -> dict[str, Any]:
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
