"""Prompt lengths in the served model's tokens, counted by the agent (`POST /v1/tokenize`).

`kvctl load` may run on another host than the agent, without the model's files or torch, so it
asks the agent, which counts exactly as its completions do. Counts are cached by text and asked
for in batches. Profiles build prompts from a small vocabulary, so one batch at the start (each
word's cost) sizes every prompt of a run: a `Lexicon`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvctl.api import MAX_TOKENIZE_TEXTS, TokenizeRequest, TokenizeResponse

WORDS = (
    *("page", "pool", "cache", "token", "prefix", "request", "memory", "segment", "batch"),
    *("decode", "prompt", "model", "layer", "block", "tensor", "queue", "agent", "shard"),
    *("sequence", "attention", "window", "budget", "extent", "table", "kernel"),
)
DEFAULT_CONTEXT = 4096
"""The context assumed when the agent does not say (the demo model's)."""
HEADROOM = 32
"""Tokens kept free beside a prompt for BOS and a chat template's role markers."""
_ANCHOR = "a"
"""Each word is counted after this one-token text, as it is in a prompt: after a space."""


class Tokenizes(Protocol):
    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse: ...


class TokenCounter:
    """Token counts of texts (no BOS), asked of the agent in batches and cached by text."""

    def __init__(
        self, client: Tokenizes, batch: int = MAX_TOKENIZE_TEXTS, model: str | None = None
    ) -> None:
        self.client = client
        self.batch = batch
        self.model = model  # the model whose tokens count (None: the agent's only one)
        self.context: int | None = None
        self.calls = 0
        self._cache: dict[str, int] = {}

    async def counts(self, texts: Sequence[str]) -> list[int]:
        missing = list(dict.fromkeys(t for t in texts if t not in self._cache))
        for start in range(0, len(missing), self.batch):
            part = missing[start : start + self.batch]
            request = TokenizeRequest(
                model=self.model, prompt=part, return_token_ids=False, add_special_tokens=False
            )
            answer = await self.client.tokenize(request)
            self.calls += 1
            self.context = answer.max_model_len
            for text, result in zip(part, answer.results, strict=True):
                self._cache[text] = result.count
        return [self._cache[t] for t in texts]


@dataclass(frozen=True)
class Lexicon:
    """What each vocabulary word costs in tokens after a space, and the model's context: turns
    a length in tokens into text of that length."""

    costs: dict[str, int]
    context: int = DEFAULT_CONTEXT

    @classmethod
    def bytes(cls, context: int = DEFAULT_CONTEXT) -> Lexicon:
        """A byte-level tokenizer's costs (the demo model's): one token per character."""
        return cls({word: len(word) + 1 for word in WORDS}, context)

    @classmethod
    async def counted(cls, counter: TokenCounter) -> Lexicon:
        """Each word's cost as the agent counts it, in one batch."""
        anchor, *with_word = await counter.counts([_ANCHOR, *(f"{_ANCHOR} {w}" for w in WORDS)])
        costs = {w: max(1, n - anchor) for w, n in zip(WORDS, with_word, strict=True)}
        return cls(costs, counter.context or DEFAULT_CONTEXT)

    def text(self, rng: random.Random, tokens: int) -> str:
        """About `tokens` tokens of words (at least one word)."""
        out: list[str] = []
        length = 0
        while length < tokens or not out:
            word = rng.choice(WORDS)
            out.append(word)
            length += self.costs[word]
        return " ".join(out)

    def room(self, max_tokens: int) -> int:
        """The longest prompt that fits the context beside `max_tokens`."""
        return max(1, self.context - max_tokens - HEADROOM)
