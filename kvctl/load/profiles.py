"""Workload profiles: the prompts and the arrival pattern of `kvctl load`, from a seed alone.

The same profile, seed and `max_tokens` always give the same requests in the same order, so a
load run can be repeated against another build or setting and the difference is the agent's.
Text is built from a small vocabulary: the demo model's tokenizer is byte-level, so a prompt's
length in characters is its length in tokens, and lengths below are written in characters.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

WORDS = (
    *("page", "pool", "cache", "token", "prefix", "request", "memory", "segment", "batch"),
    *("decode", "prompt", "model", "layer", "block", "tensor", "queue", "agent", "shard"),
    *("sequence", "attention", "window", "budget", "extent", "table", "kernel"),
)

SYSTEM_PROMPT = (
    "You are the on-call assistant of an inference cluster. Answer briefly, name the metric "
    "you read, and give one command that fixes the problem. Pages hold the keys and values "
    "of sixteen tokens; free pages are kept contiguous by the defragmenter; prefix pages are "
    "shared between requests that start with the same text.\n"
)
"""The prefix every chat request shares: what the prefix cache should find again and again."""


@dataclass(frozen=True)
class LoadRequest:
    """One completion to send: its prompt, its length limit and where it sits in the mix."""

    index: int
    prompt: str
    max_tokens: int
    conversation: int | None = None
    turn: int = 0


class Profile(Protocol):
    """What a profile sends (`requests`) and, in open loop, when (`gaps`)."""

    name: str
    summary: str
    default_rate: float | None
    """Requests per second when the run gives no --rate; None means closed loop."""

    def requests(self, rng: random.Random, max_tokens: int) -> Iterator[LoadRequest]: ...

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]: ...


def words(rng: random.Random, chars: int) -> str:
    """About `chars` characters of words (at least one word)."""
    out: list[str] = []
    length = 0
    while length < chars or not out:
        word = rng.choice(WORDS)
        out.append(word)
        length += len(word) + 1
    return " ".join(out)


def poisson_gaps(rng: random.Random, rate: float) -> Iterator[float]:
    """Seconds between arrivals of a Poisson process with `rate` requests per second."""
    while True:
        yield rng.expovariate(rate)


@dataclass(frozen=True)
class RandomLengths:
    """Independent requests, prompt lengths log-normal (many short, a few long)."""

    name: str = "random-lengths"
    summary: str = "independent prompts of log-normal length, 8 to 1500 tokens"
    default_rate: float | None = None

    def requests(self, rng: random.Random, max_tokens: int) -> Iterator[LoadRequest]:
        for index in itertools.count():
            chars = min(1500, max(8, round(rng.lognormvariate(math.log(200), 0.9))))
            tokens = rng.randint(max(1, max_tokens // 4), max_tokens)
            yield LoadRequest(index, words(rng, chars), tokens)

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        return poisson_gaps(rng, rate)


@dataclass(frozen=True)
class LongContext:
    """Long prompts near the demo model's context: few requests, many pages each."""

    name: str = "long-context"
    summary: str = "prompts of 1500 to 3000 tokens, full max_tokens each"
    default_rate: float | None = None

    def requests(self, rng: random.Random, max_tokens: int) -> Iterator[LoadRequest]:
        for index in itertools.count():
            yield LoadRequest(index, words(rng, rng.randint(1500, 3000)), max_tokens)

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        return poisson_gaps(rng, rate)


@dataclass(frozen=True)
class Burst:
    """Short requests that arrive `size` at once, then a quiet gap: the pool's worst minute."""

    name: str = "burst"
    summary: str = "bursts of 16 short prompts at once, then quiet (open loop, 8 req/s)"
    default_rate: float | None = 8.0
    size: int = 16

    def requests(self, rng: random.Random, max_tokens: int) -> Iterator[LoadRequest]:
        for index in itertools.count():
            tokens = rng.randint(max(1, max_tokens // 2), max_tokens)
            yield LoadRequest(index, words(rng, rng.randint(32, 256)), tokens)

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        """`size` arrivals together every `size / rate` seconds (jittered by ±10 %)."""
        period = self.size / rate
        for index in itertools.count():
            first = index % self.size == 0 and index > 0
            yield period * rng.uniform(0.9, 1.1) if first else 0.0


@dataclass
class _Conversation:
    history: str = ""
    turns: int = 0
    length: int = 4


@dataclass(frozen=True)
class Chat:
    """Multi-turn conversations behind one shared system prompt.

    Each turn's prompt is the system prompt, the conversation so far and a new user message, so
    consecutive turns share ever longer prefixes. The assistant's replies in the history are
    generated here, not read back from the agent, so the requests depend on the seed alone.
    """

    name: str = "chat"
    summary: str = "multi-turn conversations behind one shared system prompt"
    default_rate: float | None = None
    conversations: int = 8
    max_turns: int = 6
    history_chars: int = 1800

    def requests(self, rng: random.Random, max_tokens: int) -> Iterator[LoadRequest]:
        chats = [self._fresh(rng) for _ in range(self.conversations)]
        for index in itertools.count():
            number = rng.randrange(self.conversations)
            chat = chats[number]
            user = f"User: {words(rng, rng.randint(20, 120))}\n"
            prompt = f"{SYSTEM_PROMPT}{chat.history}{user}Assistant:"
            yield LoadRequest(index, prompt, max_tokens, number, chat.turns)
            reply = f"Assistant: {words(rng, rng.randint(max_tokens, 3 * max_tokens))}\n"
            chat.history += user + reply
            chat.turns += 1
            if chat.turns >= chat.length or len(chat.history) > self.history_chars:
                chats[number] = self._fresh(rng)

    def _fresh(self, rng: random.Random) -> _Conversation:
        return _Conversation(length=rng.randint(2, self.max_turns))

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        return poisson_gaps(rng, rate)


PROFILES: dict[str, Profile] = {
    profile.name: profile for profile in (Chat(), RandomLengths(), LongContext(), Burst())
}


def generate(name: str, seed: int, max_tokens: int, count: int) -> list[LoadRequest]:
    """The first `count` requests of a profile: the same list for the same arguments."""
    rng = random.Random(seed)
    return list(itertools.islice(PROFILES[name].requests(rng, max_tokens), count))
