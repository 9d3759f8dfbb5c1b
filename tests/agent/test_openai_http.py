"""The OpenAI surface of a real agent over real HTTP, driven by the official `openai` client
where it can be: chat (plain and streamed), completions with lists of prompts, `n`, logprobs,
echo, served model names, vLLM's extensions (those implemented, and a 400 naming each one that
is not unless it has a neutral value), the refusals of what is not supported, and OpenAI's error
shape on every error, unknown routes and methods included. A tiny transformers checkpoint with a
chat template checks the chat endpoint's ids and replies against transformers itself."""

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


def test_typical_p_reaches_the_sampler(client):
    """A sampling field goes from the wire to the sampler with no route code of its own: at a
    tiny typical_p only the token nearest the entropy is left at each step, so sampled choices
    that differ without it agree with it."""
    asked = {"model": NAMES[0], "prompt": "abc", "max_tokens": 12, "n": 3, "seed": 9}
    free = client.completions.create(**asked, temperature=1.0)
    assert len({c.text for c in free.choices}) == 3
    narrow = client.completions.create(**asked, temperature=1.0, extra_body={"typical_p": 1e-6})
    assert len({c.text for c in narrow.choices}) == 1


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


BOTH = ("/v1/completions", "/v1/chat/completions")
VLLM_REFUSED = [
    *(
        (path, name, value)
        for path in BOTH
        for name, value in [
            ("use_beam_search", True),
            ("length_penalty", 0.5),
            ("early_stopping", True),
            ("prompt_logprobs", 1),
            ("logprob_token_ids", [1]),
            ("bad_words", ["pool"]),
            ("truncate_prompt_tokens", 4),
            ("truncation_side", "middle"),
            ("structured_outputs", {"json": {"type": "object"}}),
            ("guided_json", {"type": "object"}),
            ("guided_regex", "a+"),
            ("guided_choice", ["a", "b"]),
            ("guided_grammar", "root ::= 'a'"),
            ("guided_decoding_backend", "xgrammar"),
            ("guided_whitespace_pattern", " "),
            ("watermarking", True),
            ("priority", 1),
            ("kv_transfer_params", {"do_remote_decode": True}),
            ("ec_transfer_params", {"a": 1}),
            ("vllm_xargs", {"a": 1}),
            ("repetition_detection", {"max_pattern_size": 4}),
            ("thinking_token_budget", 100),
            ("stream_interval", 4),
            ("response_format", {"type": "json_schema", "json_schema": {}}),
            ("skip_special_tokens", False),  # the demo's byte tokenizer: its specials have no text
        ]
    ),
    ("/v1/completions", "prompt_embeds", "AAAA"),
    *(
        ("/v1/chat/completions", name, value)
        for name, value in [
            ("echo", True),
            ("continue_final_message", True),
            ("chat_template", "{{ messages }}"),
            ("documents", [{"title": "a", "text": "b"}]),
            ("mm_processor_kwargs", {"a": 1}),
            ("media_io_kwargs", {"video": {}}),
            ("return_prompt_text", True),
        ]
    ),
]


@pytest.mark.parametrize(("path", "name", "value"), VLLM_REFUSED, ids=lambda x: str(x)[:20])
def test_vllm_extensions_not_implemented_are_a_400_naming_them(demo_agent, path, name, value):
    body = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    response = httpx.post(demo_agent.url + path, json={**body, name: value}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(f"{name}: ") and error["type"] == "invalid_request_error"


VLLM_NEUTRAL = {
    "use_beam_search": False,
    "length_penalty": 1,
    "early_stopping": False,
    "prompt_logprobs": None,
    "bad_words": [],
    "truncate_prompt_tokens": None,
    "truncation_side": "left",
    "structured_outputs": None,
    "guided_json": None,
    "watermarking": False,
    "priority": 0,
    "vllm_xargs": {},
    "thinking_token_budget": -1,
    "stream_interval": 1,
    "session_id": "s-1",
    "request_id": "r-1",
    "mm_payload": "none",
    "return_token_offsets": True,
    "routed_experts_prompt_start": 3,
    "spaces_between_special_tokens": False,
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "top_k": -1,
    "response_format": {"type": "text"},
}
CHAT_NEUTRAL = {
    "echo": False,
    "continue_final_message": False,
    "chat_template_kwargs": {},
    "documents": [],
    "include_reasoning": False,
    "add_generation_prompt": True,
    "add_special_tokens": False,
    "top_logprobs": 0,  # vLLM's default, without logprobs
}


def test_neutral_values_of_vllm_extensions_are_accepted(demo_agent):
    plain = {"max_tokens": 5, "temperature": 0}
    completion = httpx.post(
        f"{demo_agent.url}/v1/completions",
        json={"prompt": "Pages", **plain, **VLLM_NEUTRAL},
        timeout=60,
    )
    assert completion.status_code == 200, completion.text
    reference = httpx.post(
        f"{demo_agent.url}/v1/completions", json={"prompt": "Pages", **plain}, timeout=60
    )
    assert completion.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
    chat = httpx.post(
        f"{demo_agent.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            **plain,
            **VLLM_NEUTRAL,
            **CHAT_NEUTRAL,
        },
        timeout=60,
    )
    assert chat.status_code == 200, chat.text


def test_vllm_output_fields_over_http(demo_agent):
    url = demo_agent.url
    greedy = {"prompt": "The pool holds", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    def complete(**fields):
        response = httpx.post(f"{url}/v1/completions", json={**greedy, **fields}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    plain = complete()
    text = plain["choices"][0]["text"]
    assert plain["usage"]["prompt_tokens"] == len(b"The pool holds") + 1
    bare = complete(add_special_tokens=False, return_token_ids=True)
    assert bare["choices"][0]["prompt_token_ids"] == list(b"The pool holds")
    stop = text[4:6]
    cut = text.index(stop)
    assert complete(stop=[stop])["choices"][0]["text"] == text[:cut]
    kept = complete(stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == text[: cut + len(stop)] and kept["finish_reason"] == "stop"
    as_ids = complete(logprobs=1, return_tokens_as_token_ids=True, return_token_ids=True)
    choice = as_ids["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    messages = [{"role": "user", "content": "x"}]
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": messages,
            "max_tokens": 3,
            "logprobs": True,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        },
        timeout=60,
    ).json()["choices"][0]
    assert [t["token"] for t in chat["logprobs"]["content"]] == [
        f"token_id:{t}" for t in chat["token_ids"]
    ]


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
    opened = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    opened = opened if isinstance(opened, list) else opened["input_ids"]
    no_prompt = {**body, "add_generation_prompt": False, "max_tokens": 1}
    answer = httpx.post(f"{agent.url}/v1/chat/completions", json=no_prompt, timeout=60).json()
    assert answer["prompt_token_ids"] == opened != expected_ids
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
