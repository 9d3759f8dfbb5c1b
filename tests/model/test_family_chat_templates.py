"""The chat templates the families ship render through kvctl's sandbox exactly as transformers'
`apply_chat_template` renders them, for conversations as the chat route hands them on.

`tests/chat_templates/` holds one template per family, in the form each ships (the constructs
they use: Qwen3's reversed scan and `<think>` split, Llama 3.2's `strftime_now` date and
`tools is not none`, Mistral's alternation check and `selectattr`, gpt-oss's macros, reasoning
effort and analysis channel, Granite's `thinking` and `controls`, Gemma's folded system prompt).
Each conversation is rendered on one side from a chat request through the route's own message
and variable mapping, and on the other as vLLM hands it to transformers (text parts joined, an
assistant's reasoning as `reasoning` and `reasoning_content`, `reasoning_effort` and
`enable_thinking` as template variables): the texts are equal, or both sides refuse."""

from pathlib import Path
from typing import Any

import pytest
import tokenizers
from tokenizers import models

from kvctl.agent.chat_prompt import as_template_message, template_variables
from kvctl.agent.model.chat_template import ChatTemplate, TemplateError
from kvctl.api import ChatCompletionRequest

transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).parent.parent / "chat_templates"
SPECIAL_TOKENS = {  # family: (bos_token, eos_token), as each tokenizer_config.json names them
    "gemma3": ("<bos>", "<eos>"),
    "gpt_oss": ("<|startoftext|>", "<|return|>"),
    "granite3": ("<|end_of_text|>", "<|end_of_text|>"),
    "llama3_2": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistral": ("<s>", "</s>"),
    "olmo2": ("<|endoftext|>", "<|endoftext|>"),
    "phi4_mini": ("<|endoftext|>", "<|endoftext|>"),
    "qwen3": ("", "<|im_end|>"),
}
REASONED = {"role": "assistant", "content": "Four pages.", "reasoning": "Count the pages first."}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "one turn": [{"role": "user", "content": " What is paging? "}],
    "system and turns": [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "Why do KV caches fragment?"},
        {"role": "assistant", "content": "Sequences end at different times."},
        {"role": "user", "content": "And the fix?"},
    ],
    "text parts": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Pages,"}, {"type": "text", "text": "please."}],
        }
    ],
    "reasoning given back": [
        {"role": "user", "content": "How many pages?"},
        REASONED,
        {"role": "user", "content": "And with the prefix cache?"},
    ],
    "reasoning last": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "How many pages?"},
        {**REASONED, "reasoning": None, "reasoning_content": "Older field name."},
    ],
    "turns that do not alternate": [
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ],
}
REQUESTS: dict[str, dict[str, Any]] = {  # fields of the chat request beside the messages
    "plain": {},
    "thinking off": {"chat_template_kwargs": {"enable_thinking": False}},
    "low effort": {"reasoning_effort": "low"},
    "no effort, thinking kept": {
        "reasoning_effort": "none",
        "chat_template_kwargs": {"enable_thinking": True, "thinking": True},
    },
}


def _template(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")


def _hf(source: str, bos: str, eos: str) -> Any:
    vocab = {"<unk>": 0, **{token: i + 1 for i, token in enumerate(dict.fromkeys((bos, eos)))}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        bos_token=bos or None,
        eos_token=eos,
        unk_token="<unk>",
    )
    tokenizer.chat_template = source
    return tokenizer


def _as_vllm_hands_it_on(message: dict[str, Any]) -> dict[str, Any]:
    """vLLM's parse of a chat message for a string-content template: text parts joined by
    newlines, an assistant's reasoning (either field) as `reasoning` and `reasoning_content`."""
    content = message["content"]
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    out = {"role": message["role"], "content": content}
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if message["role"] == "assistant" and reasoning is not None:
        out["reasoning"] = out["reasoning_content"] = reasoning
    return out


def _vllm_variables(fields: dict[str, Any]) -> dict[str, Any]:
    variables = dict(fields.get("chat_template_kwargs") or {})
    if "reasoning_effort" in fields:
        variables["reasoning_effort"] = fields["reasoning_effort"]
        variables.setdefault("enable_thinking", fields["reasoning_effort"] != "none")
    return variables


def _outcome(render: Any) -> tuple[str, str]:
    """("text", the rendering), or ("refused", "") for a template that refuses (transformers
    raises jinja's errors, kvctl its TemplateError)."""
    try:
        return "text", render()
    except Exception:
        return "refused", ""


@pytest.mark.parametrize("family", sorted(SPECIAL_TOKENS))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("fields", sorted(REQUESTS))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_a_familys_template_renders_as_transformers_renders_it(
    family: str, conversation: str, fields: str, generation_prompt: bool
) -> None:
    source, (bos, eos) = _template(family), SPECIAL_TOKENS[family]
    raw = CONVERSATIONS[conversation]
    body = ChatCompletionRequest.model_validate(
        {"messages": raw, "add_generation_prompt": generation_prompt, **REQUESTS[fields]}
    )
    theirs = _outcome(
        lambda: _hf(source, bos, eos).apply_chat_template(
            [_as_vllm_hands_it_on(m) for m in raw],
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **_vllm_variables(REQUESTS[fields]),
        )
    )
    template = ChatTemplate(source, bos, eos).compile()
    ours = _outcome(
        lambda: template.render(
            [as_template_message(m) for m in body.messages],
            generation_prompt,
            template_variables(body),
        )
    )
    assert ours[0] == theirs[0], (ours, theirs)
    if ours[0] == "text":
        assert ours[1] == theirs[1]


def test_the_reasoning_and_effort_reach_the_templates_that_read_them() -> None:
    """The comparisons above are not vacuous: the reasoning a client gives back and the effort
    it asks for change what Qwen3's and gpt-oss's templates write."""
    body = ChatCompletionRequest.model_validate(
        {"messages": CONVERSATIONS["reasoning last"], "reasoning_effort": "low"}
    )
    messages, variables = [as_template_message(m) for m in body.messages], template_variables(body)
    gpt_oss = ChatTemplate(_template("gpt_oss"), *SPECIAL_TOKENS["gpt_oss"]).compile()
    text = gpt_oss.render(messages, False, variables)
    assert "Reasoning: low" in text
    assert "<|channel|>analysis<|message|>Older field name.<|end|>" in text
    assert "# Instructions\n\nBe brief." in text
    qwen3 = ChatTemplate(_template("qwen3"), *SPECIAL_TOKENS["qwen3"]).compile()
    assert "<think>\nOlder field name.\n</think>" in qwen3.render(messages, False)
    off = ChatCompletionRequest.model_validate(
        {"messages": CONVERSATIONS["one turn"], "reasoning_effort": "none"}
    )
    assert qwen3.render(
        [as_template_message(m) for m in off.messages], True, template_variables(off)
    ).endswith("<think>\n\n</think>\n\n")


def test_gemmas_refusal_of_turns_that_do_not_alternate_is_passed_on() -> None:
    twice = CONVERSATIONS["turns that do not alternate"]
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        ChatTemplate(_template("gemma3"), *SPECIAL_TOKENS["gemma3"]).compile().render(twice)


def test_tools_and_documents_are_null_as_transformers_passes_them() -> None:
    """A template that tests `tools is not none` unguarded writes no tool block."""
    source = "{% if tools is not none %}TOOLS{% endif %}{% if documents is none %}none{% endif %}"
    assert ChatTemplate(source).compile().render([{"role": "user", "content": "a"}]) == "none"
