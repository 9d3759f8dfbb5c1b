"""The OpenAI surface of a real agent over real HTTP, driven by the official `openai` client
where it can be: chat (plain and streamed), completions with lists of prompts, `n`, logprobs,
echo, served model names, the refusals of what is not supported, and OpenAI's error shape on
every error, unknown routes and methods included. A tiny transformers checkpoint with a chat
template checks the chat endpoint's ids and replies against transformers itself."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from agent_process import SMALL_POOL, launch_agent
from hf_chat import hf_greedy, save_chat_checkpoint, words

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.integration
NAMES = ("demo-chat", "house-model")


@pytest.fixture(scope="module")
def demo_agent():
    agent = launch_agent(*SMALL_POOL, *(a for n in NAMES for a in ("--served-model-name", n)))
    yield agent
    agent.stop()


@pytest.fixture(scope="module")
def client(demo_agent):
    return openai.OpenAI(base_url=f"{demo_agent.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def checkpoint_agents(tmp_path_factory):
    """(reference model, its tokenizer, agent with the chat template, agent without one)."""
    root = tmp_path_factory.mktemp("chat-ckpt")
    model, tokenizer = save_chat_checkpoint(transformers, root)
    bare = tmp_path_factory.mktemp("bare-ckpt")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(root / name, bare / name)
    with_template = launch_agent(*SMALL_POOL, "--model", str(root))
    without = launch_agent(*SMALL_POOL, "--model", str(bare))
    yield model, tokenizer, with_template, without
    with_template.stop()
    without.stop()


def test_models_list_the_served_names_with_capabilities_and_context(demo_agent):
    models = httpx.get(f"{demo_agent.url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == list(NAMES)
    for card in models:
        assert card["root"] == NAMES[0]
        assert card["capabilities"] == ["completions", "chat"]
        assert card["max_model_len"] == 4096


def test_the_openai_client_completes_and_chats(client):
    completion = client.completions.create(
        model=NAMES[1], prompt="The pool", max_tokens=6, temperature=0, logprobs=2
    )
    assert completion.model == NAMES[0]
    [choice] = completion.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == 0
    assert all(2 <= len(top) <= 3 and max(top.values()) <= 0 for top in lp.top_logprobs)
    messages = [{"role": "user", "content": "How are pages shared?"}]
    chat = client.chat.completions.create(
        model=NAMES[0],
        messages=messages,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    [answer] = chat.choices
    assert chat.object == "chat.completion" and answer.message.role == "assistant"
    assert chat.usage.completion_tokens == 8 and answer.finish_reason == "length"
    tokens = answer.logprobs.content
    assert "".join(t.token for t in tokens) == answer.message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob for t in tokens)
    stream = client.chat.completions.create(
        model=NAMES[0],
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-2].choices[0].finish_reason == "length"


def test_n_choices_sample_apart_and_greedy_ones_agree(client):
    messages = [{"role": "user", "content": "Say something"}]
    sampled = client.chat.completions.create(
        model=NAMES[0], messages=messages, max_tokens=12, n=3, seed=5, temperature=1.0
    )
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len({c.message.content for c in sampled.choices}) == 3
    again = client.chat.completions.create(
        model=NAMES[1], messages=messages, max_tokens=12, n=3, seed=5, temperature=1.0
    )
    assert [c.message.content for c in again.choices] == [
        c.message.content for c in sampled.choices
    ]
    assert sampled.usage.completion_tokens == 36
    single = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=1)
    assert sampled.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    greedy = client.completions.create(
        model=NAMES[0], prompt="abc", max_tokens=8, n=2, temperature=0
    )
    assert greedy.choices[0].text == greedy.choices[1].text


def test_a_list_of_prompts_gives_n_choices_each_in_order(demo_agent):
    body = {"prompt": ["ab", "xyz"], "n": 2, "max_tokens": 4, "temperature": 0, "echo": True}
    response = httpx.post(f"{demo_agent.url}/v1/completions", json=body, timeout=60).json()
    choices = response["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [
        c["text"][: len(p)] for c, p in zip(choices, ["ab", "ab", "xyz", "xyz"], strict=True)
    ] == [
        "ab",
        "ab",
        "xyz",
        "xyz",
    ]
    alone = httpx.post(
        f"{demo_agent.url}/v1/completions", json={**body, "prompt": "xyz", "n": 1}, timeout=60
    ).json()
    assert alone["choices"][0]["text"] == choices[2]["text"]
    assert response["usage"]["prompt_tokens"] == 3 + 4  # each prompt once, BOS included


def test_errors_come_in_openais_shape_through_the_client(client, demo_agent):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    message = missing.value.body["message"]
    assert "gpt-4o" in message and all(name in message for name in NAMES)
    with pytest.raises(openai.BadRequestError) as tools:
        client.chat.completions.create(
            model=NAMES[0],
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    assert tools.value.body["message"].startswith("tools:")
    url = demo_agent.url
    for method, path in (("GET", "/v1/nothing"), ("GET", "/v1/chat/completions")):
        response = httpx.request(method, url + path)
        assert response.status_code in (404, 405)
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["type"] and error["message"]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
        ("/v1/chat/completions", {"logit_bias": {"999": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_unsupported_or_out_of_range_fields_are_400_naming_them(demo_agent, path, body, field):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "x"}], **body}
    response = httpx.post(demo_agent.url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]


def test_unknown_fields_stay_refused(demo_agent):
    body = {"messages": [{"role": "user", "content": "x"}], "temprature": 0}
    response = httpx.post(f"{demo_agent.url}/v1/chat/completions", json=body)
    assert response.status_code == 422 and "temprature" in response.json()["error"]["message"]


def test_chat_over_http_equals_transformers(checkpoint_agents):
    model, tokenizer, agent, without = checkpoint_agents
    messages = [
        {"role": "system", "content": words([20, 21])},
        {"role": "user", "content": words([30, 31, 32])},
        {"role": "assistant", "content": words([40])},
        {"role": "user", "content": words([50, 51])},
    ]
    expected_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected_ids = expected_ids if isinstance(expected_ids, list) else expected_ids["input_ids"]
    body = {"messages": messages, "temperature": 0, "max_tokens": 24, "return_token_ids": True}
    response = httpx.post(f"{agent.url}/v1/chat/completions", json=body, timeout=60).json()
    assert response["prompt_token_ids"] == expected_ids
    [choice] = response["choices"]
    reply = hf_greedy(model, expected_ids, 24)
    assert choice["token_ids"] == reply
    assert choice["finish_reason"] == ("stop" if reply[-1] == 2 else "length")
    assert choice["message"]["content"] == tokenizer.decode(reply, skip_special_tokens=True)
    with torch.no_grad():
        first = model(torch.tensor([expected_ids])).logits[0, -1].float().log_softmax(-1)
    body = {**body, "max_tokens": 1, "logprobs": True, "top_logprobs": 2}
    lp = httpx.post(f"{agent.url}/v1/chat/completions", json=body, timeout=60).json()
    [token] = lp["choices"][0]["logprobs"]["content"]
    assert token["logprob"] == pytest.approx(float(first[reply[0]]), abs=1e-4)
    refused = httpx.post(f"{without.url}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400 and "no chat template" in refused.json()["error"]["message"]
    card = httpx.get(f"{without.url}/v1/models").json()["data"][0]
    assert card["capabilities"] == ["completions"]


def test_streamed_completion_choices_add_up(demo_agent):
    body = {"prompt": "Stream", "n": 2, "max_tokens": 5, "temperature": 0, "stream": True}
    texts = {0: "", 1: ""}
    with httpx.stream("POST", f"{demo_agent.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
    plain = httpx.post(
        f"{demo_agent.url}/v1/completions", json={**body, "stream": False, "n": 1}, timeout=60
    ).json()
    assert texts[0] == texts[1] == plain["choices"][0]["text"]
