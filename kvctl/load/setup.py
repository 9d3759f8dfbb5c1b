"""What one agent is sent: chat or text prompts, and prompt lengths in its model's tokens.

Asked of the agent before a run, so the CLI needs neither the model nor torch. Chat goes to
`/v1/chat/completions` when the model has a chat template: `/v1/models` says so in its
`capabilities`; an agent that does not list them is probed with a one-token chat request.
Without chat, text prompts go to `/v1/completions`, with a notice. Without `/v1/tokenize` (an
older agent), lengths are counted as a byte-level tokenizer would, also with a notice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvctl.api import ChatCompletionRequest, ChatMessage
from kvctl.client import (
    AgentError,
    AgentProtocolError,
    AgentRequestError,
    AsyncAgentClient,
    NotAnAgent,
)
from kvctl.load.tokens import Lexicon, TokenCounter

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True)
class LoadPlan:
    """The endpoint requests go to, how lengths are sized, and what the operator should know."""

    chat: bool = False
    lexicon: Lexicon = field(default_factory=Lexicon.bytes)
    notices: tuple[str, ...] = ()

    @property
    def endpoint(self) -> str:
        return CHAT_PATH if self.chat else COMPLETIONS_PATH


async def probe_chat(client: AsyncAgentClient) -> bool:
    """Whether a one-token chat request is served (a 4xx, or no such route, means no)."""
    request = ChatCompletionRequest(messages=[ChatMessage(role="user", content="hi")], max_tokens=1)
    try:
        async for _chunk in client.stream_chat(request):
            pass
    except (AgentRequestError, AgentProtocolError, NotAnAgent):
        return False
    return True


async def supports_chat(client: AsyncAgentClient) -> bool:
    """`chat` in the served model's capabilities; a probe when the agent lists none."""
    cards = (await client.models()).data
    capabilities = cards[0].capabilities if cards else []
    if capabilities:
        return "chat" in capabilities
    return await probe_chat(client)


async def prepare(client: AsyncAgentClient) -> LoadPlan:
    """The plan for `client`'s agent: its chat support and its tokens, in two or three calls."""
    notices: list[str] = []
    chat = await supports_chat(client)
    if not chat:
        notices.append(
            f"the model has no chat template: sending text prompts to {COMPLETIONS_PATH}"
        )
    try:
        lexicon = await Lexicon.counted(TokenCounter(client))
    except (AgentRequestError, AgentProtocolError, NotAnAgent) as error:
        cards = (await client.models()).data
        context = cards[0].max_model_len if cards and cards[0].max_model_len else None
        lexicon = Lexicon.bytes(context) if context else Lexicon.bytes()
        notices.append(f"prompt lengths estimated as one token per byte ({_reason(error)})")
    return LoadPlan(chat, lexicon, tuple(notices))


def _reason(error: AgentError) -> str:
    return error.reason or str(error).split(": ", 1)[-1]
