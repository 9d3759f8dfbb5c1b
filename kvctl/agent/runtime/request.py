"""One generation request as the engine tracks it, from arrival to finish."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import torch

from kvctl.agent.model.sampling import SamplingParams
from kvctl.agent.runtime.detokenizer import OutputText


class RequestStatus(StrEnum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # its K/V is in the pool
    FINISHED = "finished"


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop string (OpenAI's "stop")
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the client or the server shutting down
    CAPACITY = "capacity"  # lost its pages and the pool can no longer hold it


@dataclass(eq=False)
class Request:
    """A prompt, its sampling settings, and what has been generated so far.

    `num_computed` counts the tokens whose K/V are in the pool; a preempted request drops to 0
    and is recomputed from `prompt_ids + output_ids`, keeping its generator so that seeded
    sampling continues exactly where it stopped. `output_text` belongs to the output too, so
    recomputing never hands out text twice.

    `cache_salt` partitions the prefix cache (requests with different salts never share pages);
    `cached_tokens` is how many prompt tokens its first admission found in the prefix cache
    (OpenAI's `usage.prompt_tokens_details.cached_tokens`).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed: int = 0
    output_text: OutputText | None = None  # made by the engine with the first output token
    preemptions: int = 0
    cache_salt: str | None = None
    cached_tokens: int = 0
    admitted_computed: int = 0  # tokens cached or loaded at its last admission
    queued_at: float = 0.0  # when it last entered the waiting queue (engine clock)
    arrived_at: float = 0.0  # when it first entered it (engine clock)
    first_admitted_at: float | None = None  # when it first got pages (engine clock)
    finish_detail: str | None = None  # why it ended early, for "abort" and "capacity"

    @property
    def text(self) -> str:
        """The output text handed out so far; when finished, the whole output, cut before a
        stop string if one matched."""
        return self.output_text.text if self.output_text is not None else ""

    @property
    def seq_id(self) -> str:
        return self.request_id

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output: what the pool must hold once every token is computed."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
