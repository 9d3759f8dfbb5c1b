"""What the agent serves, as OpenAI clients see it: the names a request may give as `model`,
the chat template (chat exists only with one) and the context length.

Clients and routers pick a model by name, and a deployment often knows the model by another
name than its directory's (`--served-model-name`, repeatable: the first is the name reported in
every answer, the others are aliases). A request naming none of the agent's models is a 404
listing them, so a client sent to the wrong agent finds out at once instead of getting another
model's output.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvctl.agent.model.chat_template import ChatTemplate
from kvctl.api import Capability


@dataclass(frozen=True)
class ServedModel:
    names: tuple[str, ...]
    chat_template: ChatTemplate | None
    context_length: int

    @property
    def name(self) -> str:
        """The name reported in answers."""
        return self.names[0]

    @property
    def capabilities(self) -> list[Capability]:
        return ["completions", "chat"] if self.chat_template is not None else ["completions"]
