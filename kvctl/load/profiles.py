"""Workload profiles: the prompts and the arrival pattern of `kvctl load`, from a seed alone.

The same profile, seed, `max_tokens` and model always give the same requests in the same order,
so a load run can be repeated against another build or setting and the difference is the
agent's. Lengths are in the served model's tokens: text is built from a small vocabulary whose
words' costs the agent counted (`Lexicon`), and long prompts scale with the model's context.
Each request carries both a chat conversation (`messages`) and its text rendering (`prompt`),
for agents whose model has no chat template.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from kvctl.load.tokens import Lexicon

SYSTEM_PROMPT = (
    "You are the on-call assistant of an inference cluster. Answer briefly, name the metric "
    "you read, and give one command that fixes the problem. Pages hold the keys and values "
    "of sixteen tokens; free pages are kept contiguous by the defragmenter; prefix pages are "
    "shared between requests that start with the same text.\n"
)
"""The prefix every chat request shares: what the prefix cache should find again and again."""


Message = tuple[str, str]
"""A chat message: (role, content)."""


@dataclass(frozen=True)
class LoadRequest:
    """One completion to send: its prompt, its length limit and where it sits in the mix."""

    index: int
    prompt: str
    max_tokens: int
    conversation: int | None = None
    turn: int = 0
    messages: tuple[Message, ...] = ()
    """The prompt as a conversation; empty means one user message of `prompt`."""

    @property
    def chat(self) -> tuple[Message, ...]:
        return self.messages or (("user", self.prompt),)


class Profile(Protocol):
    """What a profile sends (`requests`) and, in open loop, when (`gaps`)."""

    # read-only properties: the profiles are frozen dataclasses
    @property
    def name(self) -> str: ...

    @property
    def summary(self) -> str: ...

    @property
    def default_rate(self) -> float | None:
        """Requests per second when the run gives no --rate; None means closed loop."""

    def requests(
        self, rng: random.Random, max_tokens: int, lexicon: Lexicon
    ) -> Iterator[LoadRequest]: ...

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]: ...


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

    def requests(
        self, rng: random.Random, max_tokens: int, lexicon: Lexicon
    ) -> Iterator[LoadRequest]:
        longest = min(1500, lexicon.room(max_tokens))
        for index in itertools.count():
            length = min(longest, max(8, round(rng.lognormvariate(math.log(200), 0.9))))
            tokens = rng.randint(max(1, max_tokens // 4), max_tokens)
            yield LoadRequest(index, lexicon.text(rng, length), tokens)

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        return poisson_gaps(rng, rate)


@dataclass(frozen=True)
class LongContext:
    """Long prompts near the model's context: few requests, many pages each."""

    name: str = "long-context"
    summary: str = "prompts of 3/8 to 3/4 of the model's context in tokens, full max_tokens"
    default_rate: float | None = None

    def requests(
        self, rng: random.Random, max_tokens: int, lexicon: Lexicon
    ) -> Iterator[LoadRequest]:
        high = max(1, min(lexicon.context * 3 // 4, lexicon.room(max_tokens)))
        low = min(high, lexicon.context * 3 // 8)
        for index in itertools.count():
            yield LoadRequest(index, lexicon.text(rng, rng.randint(low, high)), max_tokens)

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        return poisson_gaps(rng, rate)


@dataclass(frozen=True)
class Burst:
    """Short requests that arrive `size` at once, then a quiet gap: the pool's worst minute."""

    name: str = "burst"
    summary: str = "bursts of 16 prompts of 32 to 256 tokens, then quiet (open loop, 8 req/s)"
    default_rate: float | None = 8.0
    size: int = 16

    def requests(
        self, rng: random.Random, max_tokens: int, lexicon: Lexicon
    ) -> Iterator[LoadRequest]:
        longest = min(256, lexicon.room(max_tokens))
        for index in itertools.count():
            tokens = rng.randint(max(1, max_tokens // 2), max_tokens)
            length = rng.randint(min(32, longest), longest)
            yield LoadRequest(index, lexicon.text(rng, length), tokens)

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        """`size` arrivals together every `size / rate` seconds (jittered by ±10 %)."""
        period = self.size / rate
        for index in itertools.count():
            first = index % self.size == 0 and index > 0
            yield period * rng.uniform(0.9, 1.1) if first else 0.0


@dataclass
class _Conversation:
    history: list[Message] = field(default_factory=list)
    tokens: int = 0
    turns: int = 0
    length: int = 4

    @property
    def text(self) -> str:
        names = {"user": "User", "assistant": "Assistant"}
        return "".join(f"{names[role]}: {content}\n" for role, content in self.history)


@dataclass(frozen=True)
class Chat:
    """Multi-turn conversations behind one shared system prompt.

    Each turn is the system prompt, the conversation so far and a new user message, so
    consecutive turns share ever longer prefixes. The assistant's replies in the history are
    generated here, not read back from the agent, so the requests depend on the seed alone.
    Lengths are in tokens: user messages of 20 to 120, replies of 1 to 3 times max_tokens, a
    history of at most `history_tokens` (less where the context is smaller).
    """

    name: str = "chat"
    summary: str = "multi-turn conversations behind one shared system prompt, to 1800 tokens"
    default_rate: float | None = None
    conversations: int = 8
    max_turns: int = 6
    history_tokens: int = 1800

    def requests(
        self, rng: random.Random, max_tokens: int, lexicon: Lexicon
    ) -> Iterator[LoadRequest]:
        chats = [self._fresh(rng) for _ in range(self.conversations)]
        # beside the history: the system prompt (~300 tokens at worst, byte-level), a new turn
        history = max(0, min(self.history_tokens, lexicon.room(max_tokens) - 420))
        for index in itertools.count():
            number = rng.randrange(self.conversations)
            chat = chats[number]
            user_tokens = rng.randint(20, 120)
            user = lexicon.text(rng, user_tokens)
            prompt = f"{SYSTEM_PROMPT}{chat.text}User: {user}\nAssistant:"
            messages = (("system", SYSTEM_PROMPT.strip()), *chat.history, ("user", user))
            yield LoadRequest(index, prompt, max_tokens, number, chat.turns, messages)
            reply_tokens = rng.randint(max_tokens, 3 * max_tokens)
            reply = lexicon.text(rng, reply_tokens)
            chat.history += [("user", user), ("assistant", reply)]
            chat.tokens += user_tokens + reply_tokens
            chat.turns += 1
            if chat.turns >= chat.length or chat.tokens > history:
                chats[number] = self._fresh(rng)

    def _fresh(self, rng: random.Random) -> _Conversation:
        return _Conversation(length=rng.randint(2, self.max_turns))

    def gaps(self, rng: random.Random, rate: float) -> Iterator[float]:
        return poisson_gaps(rng, rate)


_ALL: tuple[Profile, ...] = (Chat(), RandomLengths(), LongContext(), Burst())
PROFILES: dict[str, Profile] = {profile.name: profile for profile in _ALL}


def generate(
    name: str, seed: int, max_tokens: int, count: int, lexicon: Lexicon | None = None
) -> list[LoadRequest]:
    """The first `count` requests of a profile: the same list for the same arguments
    (`lexicon` defaults to a byte-level tokenizer's, the demo model's)."""
    rng = random.Random(seed)
    stream = PROFILES[name].requests(rng, max_tokens, lexicon or Lexicon.bytes())
    return list(itertools.islice(stream, count))
