"""What happens to a row of logits besides sampling: OpenAI's presence and frequency penalties,
`logit_bias`, `min_tokens`, and the log-probabilities a request asked to see.

Penalties follow OpenAI's definition over the tokens generated so far (the prompt does not
count): `logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty`. They and
the bias are added to the raw logits before temperature, top-k and top-p, so greedy requests see
them too. Log-probabilities are reported from the model's own distribution (log-softmax of the
raw logits, before any of this), which is what the model believes regardless of the sampling
settings; docs/operations.md says why.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvctl.api import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

if TYPE_CHECKING:
    from kvctl.agent.model.sampling import SamplingParams

MAX_PENALTY = 2.0
MAX_BIAS = 100.0
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the `top` alternatives, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_processing(params: SamplingParams) -> None:
    """Raise ValueError naming the first processing field out of its range."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not _finite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
    bias = params.logit_bias
    if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to a bias")
    for token, value in bias:
        if not _token(token) or not _finite(value) or not -MAX_BIAS <= value <= MAX_BIAS:
            raise ValueError(
                f"logit_bias maps token ids ≥ 0 to numbers in [-100, 100], got {token!r}: {value!r}"
            )
    logprobs = params.logprobs
    if logprobs is not None and (not _token(logprobs) or logprobs > MAX_LOGPROBS):
        raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}")
    stop_ids = params.stop_token_ids
    if not isinstance(stop_ids, tuple) or len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids must list at most {MAX_STOP_TOKEN_IDS} token ids")
    if not all(_token(t) for t in stop_ids):
        raise ValueError(f"stop_token_ids must be token ids ≥ 0, got {list(stop_ids)!r}")
    if not _token(params.min_tokens) or params.min_tokens > params.max_tokens:
        raise ValueError(
            f"min_tokens must be an integer in [0, max_tokens {params.max_tokens}], "
            f"got {params.min_tokens!r}"
        )


def check_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError when `logit_bias` or `stop_token_ids` names a token the model lacks."""
    named = [t for t, _ in params.logit_bias] + list(params.stop_token_ids)
    outside = sorted({t for t in named if t >= vocab_size})
    if outside:
        raise ValueError(
            f"token ids {outside[:5]} in logit_bias or stop_token_ids are outside the "
            f"vocabulary [0, {vocab_size})"
        )


def process_logits(
    logits: Tensor,
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]],
    eos_token_ids: Collection[int],
) -> Tensor:
    """logits [B, vocab] with each row's penalties, bias and `min_tokens` applied (a new tensor
    when any row has them, else `logits` itself). `outputs` are the rows' generated ids."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    logits = logits.float().clone()
    vocab, device = logits.shape[-1], logits.device
    for i in rows:
        p, row = params[i], logits[i]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=device)
            row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=device))
        if (p.presence_penalty or p.frequency_penalty) and outputs[i]:
            ids = torch.tensor(list(outputs[i]), device=device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].to(row.dtype)
            row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty
        if len(outputs[i]) < p.min_tokens:
            enders = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            if enders:
                row[torch.tensor(sorted(enders), device=device)] = -math.inf
    return logits


def token_logprobs(
    logits: Tensor, chosen: Sequence[int], params: Sequence[SamplingParams]
) -> list[TokenLogprobs | None]:
    """Per row, the chosen token's log-probability under the raw logits and the row's top
    `logprobs` alternatives; None for rows that asked for none."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)  # [R, vocab]
    chosen_rows = torch.tensor([chosen[i] for i in rows], device=logits.device)
    picked = logprobs.gather(1, chosen_rows[:, None]).squeeze(1).tolist()
    most = max(params[i].logprobs or 0 for i in rows)
    top_values, top_ids = logprobs.topk(min(most, logprobs.shape[-1]), dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for r, i in enumerate(rows):
        k = params[i].logprobs or 0
        top = tuple(zip(top_ids[r][:k], top_values[r][:k], strict=True))
        result[i] = TokenLogprobs(picked[r], top)
    return result


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
