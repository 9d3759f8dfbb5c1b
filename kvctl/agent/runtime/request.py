"""One generation request as the engine tracks it, from arrival to finish."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import torch

from kvctl.agent.model.sampling import SamplingParams


class RequestStatus(StrEnum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # its K/V is in the pool
    FINISHED = "finished"


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop string (OpenAI's "stop")
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the client or the server shutting down


@dataclass(eq=False)
class Request:
    """A prompt, its sampling settings, and what has been generated so far.

    `num_computed` counts the tokens whose K/V are in the pool; a preempted request drops to 0
    and is recomputed from `prompt_ids + output_ids`, keeping its generator so that seeded
    sampling continues exactly where it stopped.

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
    text: str = ""  # decoded output, cut at a stop string when one matched
    sent_text: int = 0  # characters of `text` already handed out as deltas
    preemptions: int = 0
    cache_salt: str | None = None
    cached_tokens: int = 0

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
