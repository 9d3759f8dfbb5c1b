"""vLLM's benchmark client (`vllm bench serve`) against a real agent over HTTP, unchanged: the
exact payloads of its `openai` and `openai-chat` backends (vllm/benchmarks/lib/
endpoint_request_func.py: `repetition_penalty: 1.0` and `logprobs: null` on completions,
`max_completion_tokens` and text parts on chat, always streamed with
`stream_options.include_usage`, `ignore_eos` with --ignore-eos, the sampling flags --temperature
--top-p --top-k --min-p --repetition-penalty --frequency-penalty --presence-penalty merged into
the body), read the way that client reads them: its SSE splitting, `choices[0].text` or
`delta.content` of every chunk with choices, usage from the chunk without. vLLM is not a
dependency, so its reading code is restated here as it is there."""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.integration

OUTPUT_LEN = 12
PROMPT = "The pool holds pages of key and value tensors for every request"
SAMPLING_FLAGS = [
    {},  # vllm bench serve sets none unless asked: the server's defaults
    {"temperature": 0.0},
    {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    {"temperature": 0.7, "frequency_penalty": 0.3, "presence_penalty": 0.2, "top_k": -1},
]


class StreamedResponseHandler:
    """vLLM's: accumulate bytes until whole SSE messages (split on a blank line) are there."""

    def __init__(self) -> None:
        self.buffer = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def add_chunk(self, chunk_bytes: bytes) -> list[str]:
        self.buffer += self._decoder.decode(chunk_bytes)
        messages = []
        while "\n\n" in self.buffer:
            message, self.buffer = self.buffer.split("\n\n", 1)
            message = message.strip()
            if message:
                messages.append(message)
        if self.buffer.startswith("data: "):
            content = self.buffer.removeprefix("data: ").strip()
            if content == "[DONE]":
                messages.append(self.buffer.strip())
                self.buffer = ""
            elif content:
                try:
                    json.loads(content)
                    messages.append(self.buffer.strip())
                    self.buffer = ""
                except json.JSONDecodeError:
                    pass
        return messages


@dataclass
class Output:
    """What the client records of one request (its RequestFuncOutput, less the timings)."""

    status: int = 0
    generated_text: str = ""
    chunks: int = 0  # chunks with choices: the first is its TTFT, the others its ITLs
    output_tokens: int | None = None
    prompt_len: int | None = None
    success: bool = False
    done: bool = False
    errors: list[str] = field(default_factory=list)


def run_client(url: str, payload: dict[str, Any], chat: bool) -> Output:
    """One request as `async_request_openai_completions` / `..._chat_completions` sends and
    reads it."""
    output = Output()
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", url, json=payload, headers={"Content-Type": "application/json"}) as r,
    ):
        output.status = r.status_code
        if r.status_code != 200:
            output.errors.append(r.read().decode())
            return output
        handler = StreamedResponseHandler()
        for chunk_bytes in r.iter_bytes():
            chunk_bytes = chunk_bytes.strip()
            if not chunk_bytes:
                continue
            for message in handler.add_chunk(chunk_bytes):
                if message.startswith(":"):
                    continue
                chunk = message.removeprefix("data: ")
                if chunk == "[DONE]":
                    output.done = True
                    continue
                data = json.loads(chunk)
                if choices := data.get("choices"):
                    text = choices[0]["delta"].get("content") if chat else choices[0].get("text")
                    output.chunks += 1
                    output.generated_text += text or ""
                elif usage := data.get("usage"):
                    output.output_tokens = usage.get("completion_tokens")
                    output.prompt_len = usage.get("prompt_tokens")
    output.success = output.chunks > 0
    return output


def completions_payload(model: str, sampling: dict[str, Any]) -> dict[str, Any]:
    payload = {
        "model": model,
        "prompt": PROMPT,
        "repetition_penalty": 1.0,
        "max_tokens": OUTPUT_LEN,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return payload | {"ignore_eos": True} | sampling


def chat_payload(model: str, sampling: dict[str, Any]) -> dict[str, Any]:
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "max_completion_tokens": OUTPUT_LEN,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return payload | {"ignore_eos": True} | sampling


@pytest.fixture(scope="module")
def model(agent) -> str:
    return httpx.get(f"{agent.url}/v1/models").json()["data"][0]["id"]


@pytest.mark.parametrize("sampling", SAMPLING_FLAGS, ids=lambda s: ",".join(s) or "defaults")
@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_the_benchmark_client_reads_every_token_and_the_usage(agent, model, backend, sampling):
    chat = backend == "openai-chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    payload = (chat_payload if chat else completions_payload)(model, sampling)
    output = run_client(agent.url + path, payload, chat)
    assert output.status == 200, output.errors
    assert output.success and output.done and not output.errors
    assert output.output_tokens == OUTPUT_LEN  # ignore_eos: every token it asked for
    assert output.chunks == OUTPUT_LEN + chat  # a chunk per token (chat: the role first)
    if chat:
        assert output.prompt_len is not None and output.prompt_len > len(PROMPT.encode())
    else:
        assert output.prompt_len == len(PROMPT.encode()) + 1  # the demo's bytes and BOS
    unstreamed = {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}
    if sampling.get("temperature") == 0.0:  # greedy: the same text the plain answer has
        answer = httpx.post(agent.url + path, json=unstreamed, timeout=120).json()
        choice = answer["choices"][0]
        assert output.generated_text == (choice["message"]["content"] if chat else choice["text"])
        assert answer["usage"]["completion_tokens"] == OUTPUT_LEN
