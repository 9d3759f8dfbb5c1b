"""What one agent is sent: chat or text prompts, and prompt lengths in its model's tokens.

Asked of the agent before a run, so the CLI needs neither the model nor torch. Chat goes to
`/v1/chat/completions` when the model has a chat template: `/v1/models` says so in its
`capabilities`; an agent that does not list them is probed with a one-token chat request.
Without chat, text prompts go to `/v1/completions`, with a notice. Without `/v1/tokenize` (an
older agent), lengths are counted as a byte-level tokenizer would, also with a notice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvctl.api import ChatCompletionRequest, ChatMessage, ModelCard
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


class ModelRequired(ValueError):
    """The agent serves several models and the run named none (or one it does not serve)."""


async def probe_chat(client: AsyncAgentClient, model: str | None = None) -> bool:
    """Whether a one-token chat request is served (a 4xx, or no such route, means no)."""
    request = ChatCompletionRequest(
        model=model, messages=[ChatMessage(role="user", content="hi")], max_tokens=1
    )
    try:
        async for _chunk in client.stream_chat(request):
            pass
    except (AgentRequestError, AgentProtocolError, NotAnAgent):
        return False
    return True


async def model_card(client: AsyncAgentClient, model: str | None) -> ModelCard | None:
    """The card of `model`, or of the agent's only model; ModelRequired when the agent serves
    several and none (or an unknown one) is named."""
    cards = (await client.models()).data
    models = list(dict.fromkeys(card.root or card.id for card in cards))
    if model is not None:
        card = next((c for c in cards if c.id == model), None)
        if card is None and cards:
            raise ModelRequired(f"the agent does not serve {model!r}; it serves {_names(models)}")
        return card
    if len(models) > 1:
        raise ModelRequired(f"the agent serves several models ({_names(models)}); give --model")
    return cards[0] if cards else None


def _names(models: list[str]) -> str:
    return ", ".join(repr(m) for m in models)


async def supports_chat(client: AsyncAgentClient, model: str | None = None) -> bool:
    """`chat` in the served model's capabilities; a probe when the agent lists none."""
    card = await model_card(client, model)
    capabilities = card.capabilities if card else []
    if capabilities:
        return "chat" in capabilities
    return await probe_chat(client, model)


async def prepare(client: AsyncAgentClient, model: str | None = None) -> LoadPlan:
    """The plan for `client`'s agent (its model `model` when it serves several): its chat
    support and its tokens, in two or three calls."""
    notices: list[str] = []
    chat = await supports_chat(client, model)
    if not chat:
        notices.append(
            f"the model has no chat template: sending text prompts to {COMPLETIONS_PATH}"
        )
    try:
        lexicon = await Lexicon.counted(TokenCounter(client, model=model))
    except (AgentRequestError, AgentProtocolError, NotAnAgent) as error:
        card = await model_card(client, model)
        context = card.max_model_len if card and card.max_model_len else None
        lexicon = Lexicon.bytes(context) if context else Lexicon.bytes()
        notices.append(f"prompt lengths estimated as one token per byte ({_reason(error)})")
    return LoadPlan(chat, lexicon, tuple(notices))


def _reason(error: AgentError) -> str:
    return error.reason or str(error).split(": ", 1)[-1]
