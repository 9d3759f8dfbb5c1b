"""Chat through the checkpoint's template against transformers: the rendered ids equal
`apply_chat_template`'s, and greedy replies equal transformers' decoding, ending at EOS."""

import json

import pytest
import torch
from hf_chat import TEMPLATE, hf_greedy, save_chat_checkpoint, words

from kvctl.agent.model import load_checkpoint
from kvctl.agent.model.chat_template import TemplateError, read_chat_template
from kvctl.agent.model.sampling import SamplingParams
from kvctl.agent.runtime import Engine, EngineConfig

transformers = pytest.importorskip("transformers")

CONVERSATIONS = {
    "one turn": [{"role": "user", "content": words([7, 8, 9])}],
    "multi-turn": [
        {"role": "system", "content": words([20, 21])},
        {"role": "user", "content": words([30, 31, 32])},
        {"role": "assistant", "content": words([40])},
        {"role": "user", "content": words([50, 51])},
    ],
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    model, tokenizer = save_chat_checkpoint(transformers, root)
    return model, tokenizer, root


def encode(root, messages):
    template = read_chat_template(root)
    _, _, tokenizer = load_checkpoint(root, "cpu", torch.float32)
    text = template.render(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=template.add_special_tokens)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_rendered_ids_equal_apply_chat_template(checkpoint, name):
    _, tokenizer, root = checkpoint
    messages = CONVERSATIONS[name]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if not isinstance(expected, list) else expected
    assert encode(root, messages) == expected


def test_the_template_in_tokenizer_config_is_read_too(checkpoint, tmp_path):
    _, _, root = checkpoint
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / name).write_bytes((root / name).read_bytes())
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert not (tmp_path / "chat_template.jinja").exists()
    messages = CONVERSATIONS["multi-turn"]
    assert encode(tmp_path, messages) == encode(root, messages)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert read_chat_template(tmp_path) is None


def test_the_template_runs_sandboxed_and_refuses_with_its_message(checkpoint):
    _, _, root = checkpoint
    template = read_chat_template(root)
    with pytest.raises(TemplateError, match="unknown role tool"):
        template.render([{"role": "tool", "content": "w7"}])
    from kvctl.agent.model.chat_template import ChatTemplate

    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").compile()
    with pytest.raises(TemplateError):
        escape.render([{"role": "user", "content": "w7"}])


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_greedy_reply_equals_transformers_and_stops_at_eos(checkpoint, name):
    model, _, root = checkpoint
    messages = CONVERSATIONS[name]
    ids = encode(root, messages)
    _, ours, tokenizer = load_checkpoint(root, "cpu", torch.float32)
    engine = Engine(ours, tokenizer, EngineConfig(pool_pages=64, segment_pages=16, page_size=4))
    [request] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=40))
    expected = hf_greedy(model, ids, 40)
    assert request.output_ids == expected
    if expected[-1] == 2:  # the generation config's EOS ends the reply, not max_tokens
        assert request.finish_reason == "stop"


def test_eos_from_generation_config_ends_the_reply(checkpoint):
    """With EOS forced by a bias, the reply is one EOS token and finishes with `stop`."""
    _, _, root = checkpoint
    _, ours, tokenizer = load_checkpoint(root, "cpu", torch.float32)
    engine = Engine(ours, tokenizer, EngineConfig(pool_pages=64, segment_pages=16, page_size=4))
    ids = encode(root, CONVERSATIONS["one turn"])
    params = SamplingParams(temperature=0, max_tokens=10, logit_bias={"2": 100.0})
    [request] = engine.generate([ids], params)
    assert request.output_ids == [2] and request.finish_reason == "stop" and request.text == ""
