"""The chat templates the families ship render through kvctl's sandbox exactly as transformers'
`apply_chat_template` renders them: Gemma's folds the system prompt into the first user turn,
names the assistant "model" and refuses turns that do not alternate."""

import pytest
import tokenizers
from tokenizers import models

from kvctl.agent.model.chat_template import ChatTemplate, TemplateError

transformers = pytest.importorskip("transformers")

GEMMA3 = (  # google/gemma-3-1b-it, tokenizer_config.json
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate '
    'user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)
TEMPLATES = {"gemma3": (GEMMA3, "<bos>", "<eos>")}
CONVERSATIONS = {
    "one turn": [{"role": "user", "content": " What is paging? "}],
    "system and turns": [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "Why do KV caches fragment?"},
        {"role": "assistant", "content": "Sequences end at different times."},
        {"role": "user", "content": "And the fix?"},
    ],
    "text parts": [{"role": "user", "content": [{"type": "text", "text": "Pages, please."}]}],
}


def _hf(source: str, bos: str, eos: str):
    vocab = {"<unk>": 0, bos: 1, eos: 2}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        bos_token=bos,
        eos_token=eos,
        unk_token="<unk>",
    )
    tokenizer.chat_template = source
    return tokenizer


@pytest.mark.parametrize("family", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_a_familys_template_renders_as_transformers_renders_it(
    family: str, conversation: str, generation_prompt: bool
) -> None:
    source, bos, eos = TEMPLATES[family]
    messages = CONVERSATIONS[conversation]
    expected = _hf(source, bos, eos).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    ours = ChatTemplate(source, bos, eos).compile().render(messages, generation_prompt)
    assert ours == expected


def test_gemmas_refusal_of_turns_that_do_not_alternate_is_passed_on() -> None:
    source, bos, eos = TEMPLATES["gemma3"]
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        ChatTemplate(source, bos, eos).compile().render(twice)
