"""What happens to a batch's logits before the choice, in vLLM's order: `allowed_token_ids`,
`min_tokens`, `logit_bias`, the repetition penalty, OpenAI's presence and frequency penalties;
and the log-probabilities a request asked to see.

Definitions: the repetition penalty is transformers' and vLLM's (over the tokens of the prompt
and the output, a logit > 0 is divided by it, a logit < 0 multiplied); presence and frequency
are OpenAI's over the tokens generated so far (the prompt does not count): `logit[j] -=
count[j] * frequency_penalty + (count[j] > 0) * presence_penalty`. All of it changes the raw
logits before temperature, min-p, top-k and top-p, so greedy requests see it too.
Log-probabilities are reported from the model's own distribution (log-softmax of the raw logits,
before any of this), which is what the model believes regardless of the sampling settings;
docs/operations.md says why.

The rows that have any of these change together, a few tensor ops for the batch. What a request
needs across steps is a row of `RequestRows`' tables on the logits' device (one `RequestRows`
per engine, which its sampler holds): its output tokens'
counts (each new token added as it comes, never recounted, so a step costs the same at the
4,000th token as at the first), its prompt's tokens, its bias and its blocked tokens.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from kvctl.agent.model.sampling import SamplingParams


class Generating(Protocol):
    """What logits processing reads of a request: its settings, its tokens, whether it ended."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def output_ids(self) -> list[int]: ...

    @property
    def finished(self) -> bool: ...


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the `top` alternatives, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError when `logit_bias`, `allowed_token_ids` or `stop_token_ids` names a token
    the model lacks."""
    named = [t for t, _ in params.bias]
    named += [*(params.allowed_token_ids or ()), *(params.stop_token_ids or ())]
    outside = sorted({t for t in named if t >= vocab_size})
    if outside:
        raise ValueError(
            f"token ids {outside[:5]} in logit_bias, allowed_token_ids or stop_token_ids are "
            f"outside the vocabulary [0, {vocab_size})"
        )


def process_logits(
    logits: Tensor,
    requests: Sequence[Generating],
    eos_token_ids: Collection[int],
    rows: RequestRows,
) -> Tensor:
    """logits [B, vocab] with each request's processing applied: a new float32 tensor when any
    request has some, else `logits` itself. `rows` keeps the requests' rows between steps (one
    per engine)."""
    chosen = [i for i, r in enumerate(requests) if r.params.processes_logits]
    if not chosen:
        return logits
    out = logits.float().clone()
    index = None if len(chosen) == len(requests) else torch.tensor(chosen, device=out.device)
    x = out if index is None else out.index_select(0, index)
    processed = [requests[i] for i in chosen]
    tables = rows.gather(processed, out.shape[-1], out.device)
    if tables.blocked is not None:
        x.masked_fill_(tables.blocked, -math.inf)
    _end_later(x, processed, eos_token_ids)
    if tables.bias is not None:
        x += tables.bias
    if tables.output is not None and tables.prompt is not None:
        x = _penalise(x, [r.params for r in processed], tables.output, tables.prompt)
    if index is None:
        return x
    return out.index_copy_(0, index, x)


@dataclass(frozen=True)
class Tables:
    """One step's rows of `RequestRows`' tables, one per processed request (None where no
    request in the step uses that table)."""

    output: Tensor | None
    prompt: Tensor | None
    bias: Tensor | None
    blocked: Tensor | None


class RequestRows:
    """Per request that processes its logits, a row of [slots, vocab] tables on the logits'
    device: `output` counts its output tokens, `prompt` marks its prompt's tokens (both for
    penalties), `bias` is its logit_bias and `blocked` the tokens outside its allowed_token_ids.

    A row is filled when its request first comes and then only takes the request's new output
    tokens. A table is made when a request first needs it; a request's rows in tables it does
    not need stay zero (no bias, nothing blocked). A row is reused once its request has finished
    or is gone; the tables double when every row is taken."""

    def __init__(self) -> None:
        self._reset(0, torch.device("cpu"))

    def _reset(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.tables: dict[str, Tensor] = {}
        self.capacity = 0
        self._slot: weakref.WeakKeyDictionary[Generating, int] = weakref.WeakKeyDictionary()
        self._owner: list[weakref.ref[Generating] | None] = []
        self._counted: list[int] = []  # output tokens already in each slot's `output` row

    def gather(self, requests: Sequence[Generating], vocab: int, device: torch.device) -> Tables:
        """The rows of `requests` in logits of `vocab` tokens on `device`, brought up to date
        with their tokens."""
        if (vocab, device) != (self.vocab, self.device):
            self._reset(vocab, device)
        needed = {name for r in requests for name in _tables_of(r.params)}
        if not needed:  # min_tokens alone: nothing kept across steps
            return Tables(None, None, None, None)
        fresh: list[tuple[int, Generating]] = []
        slots: list[int] = []
        counted_rows: list[int] = []
        counted_ids: list[int] = []
        for request in requests:
            slot = self._slot.get(request)
            if slot is None:
                slot = self._allocate(request)
                fresh.append((slot, request))
            if _penalised(request.params):
                new = request.output_ids[self._counted[slot] :]
                counted_rows += [slot] * len(new)
                counted_ids += new
                self._counted[slot] += len(new)
            slots.append(slot)
        if fresh:
            self._fill(fresh)
        if counted_ids:
            self.tables["output"].index_put_(
                (self._ids(counted_rows), self._ids(counted_ids)),
                torch.ones(len(counted_ids), device=self.device),
                accumulate=True,
            )
        index = self._ids(slots)
        rows = {name: self.tables[name].index_select(0, index) for name in needed}
        return Tables(rows.get("output"), rows.get("prompt"), rows.get("bias"), rows.get("blocked"))

    def _fill(self, fresh: list[tuple[int, Generating]]) -> None:
        """Zero the new requests' rows, then write what they need (tables made on first use)."""
        wanted = {name for _, r in fresh for name in _tables_of(r.params)}
        for name in sorted(wanted - self.tables.keys()):
            dtype = torch.bool if name in ("prompt", "blocked") else torch.float32
            self.tables[name] = torch.zeros(
                self.capacity, self.vocab, dtype=dtype, device=self.device
            )
        index = self._ids([slot for slot, _ in fresh])
        for table in self.tables.values():
            table.index_fill_(0, index, 0)
        writes: dict[str, tuple[list[int], list[int], list[float]]] = {}
        for slot, request in fresh:
            params = request.params
            for name in _tables_of(params):
                rows, ids, values = writes.setdefault(name, ([], [], []))
                if name == "prompt":
                    tokens = request.prompt_ids
                elif name == "bias":
                    tokens = [t for t, _ in params.bias]
                    values += [b for _, b in params.bias]
                elif name == "blocked":
                    tokens = list(params.allowed_token_ids or ())
                else:
                    continue  # `output` takes the request's tokens in `gather`
                rows += [slot] * len(tokens)
                ids += tokens
        for name, (rows, ids, values) in writes.items():
            table, at = self.tables[name], (self._ids(rows), self._ids(ids))
            if name == "bias":
                table.index_put_(at, torch.tensor(values, device=self.device), accumulate=True)
            elif name == "prompt":
                table.index_put_(at, torch.tensor(True, device=self.device))
            elif name == "blocked":  # all of the row, then not the allowed ids
                table.index_fill_(0, self._ids(sorted(set(rows))), True)
                table.index_put_(at, torch.tensor(False, device=self.device))

    def _allocate(self, request: Generating) -> int:
        free = [s for s, owner in enumerate(self._owner) if owner is None]
        if not free:
            free = self._reclaim() or self._grow()
        slot = free[0]
        self._owner[slot] = weakref.ref(request)
        self._slot[request] = slot
        self._counted[slot] = 0
        return slot

    def _reclaim(self) -> list[int]:
        """Free the rows of requests that finished or are gone; their slots."""
        freed = []
        for slot, owner in enumerate(self._owner):
            request = owner() if owner is not None else None
            if request is None or request.finished:
                if request is not None:
                    self._slot.pop(request, None)
                self._owner[slot] = None
                freed.append(slot)
        return freed

    def _grow(self) -> list[int]:
        """Double the tables (at least 4 rows); the new slots."""
        old, self.capacity = self.capacity, max(4, 2 * self.capacity)
        for name, table in self.tables.items():
            more = torch.zeros(
                self.capacity - old, self.vocab, dtype=table.dtype, device=self.device
            )
            self.tables[name] = torch.cat([table, more])
        self._owner += [None] * (self.capacity - old)
        self._counted += [0] * (self.capacity - old)
        return list(range(old, self.capacity))

    def _ids(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _penalised(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty) or (
        params.repetition_penalty != 1
    )


def _tables_of(params: SamplingParams) -> list[str]:
    """The tables a request's rows are written in."""
    names = []
    if _penalised(params):
        names.append("output")
        names.append("prompt")
    if params.logit_bias:
        names.append("bias")
    if params.allowed_token_ids:
        names.append("blocked")
    return names


def _end_later(x: Tensor, requests: Sequence[Generating], eos_token_ids: Collection[int]) -> None:
    """EOS (unless ignore_eos) and stop_token_ids cannot be chosen before `min_tokens`."""
    rows: list[int] = []
    ids: list[int] = []
    for j, request in enumerate(requests):
        params = request.params
        if len(request.output_ids) >= params.min_tokens:
            continue
        enders = set(params.stop_token_ids or ()) | (
            set() if params.ignore_eos else set(eos_token_ids)
        )
        rows += [j] * len(enders)
        ids += sorted(enders)
    if ids:
        at = (torch.tensor(rows, device=x.device), torch.tensor(ids, device=x.device))
        x.index_put_(at, torch.tensor(-math.inf, device=x.device))


def _penalise(
    x: Tensor, params: Sequence[SamplingParams], output: Tensor, prompt: Tensor
) -> Tensor:
    """The repetition penalty over prompt and output tokens, then frequency and presence over
    the output's counts, each only when some row has it (rows without it get factors that
    change nothing exactly). `x` is the caller's own tensor: changed in place where it can be."""
    factors = torch.tensor(
        [[p.repetition_penalty, -p.frequency_penalty, -p.presence_penalty] for p in params],
        device=x.device,
    )
    repetition = any(p.repetition_penalty != 1 for p in params)
    presence = any(p.presence_penalty for p in params)
    present = output > 0 if repetition or presence else None
    if repetition and present is not None:
        penalty = factors[:, :1]
        x = torch.where(prompt | present, torch.where(x > 0, x / penalty, x * penalty), x)
    if any(p.frequency_penalty for p in params):
        x.addcmul_(output, factors[:, 1:2])
    if presence and present is not None:
        x.addcmul_(present, factors[:, 2:3])
    return x


def token_logprobs(
    logits: Tensor, chosen: Tensor, params: Sequence[SamplingParams]
) -> list[TokenLogprobs | None]:
    """Per row, the chosen token's log-probability under the raw logits and the row's top
    `logprobs` alternatives; None for rows that asked for none. `chosen` [B] stays where the
    logits are; what the rows asked for comes to the host in one copy."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)  # [R, vocab]
    picked = logprobs.gather(1, chosen.index_select(0, index)[:, None])  # [R, 1]
    most = max(params[i].logprobs or 0 for i in rows)
    top_values, top_ids = logprobs.topk(min(most, logprobs.shape[-1]), dim=-1)
    values = torch.cat([picked, top_values], dim=1).tolist()
    ids = top_ids.tolist()
    for r, i in enumerate(rows):
        k = params[i].logprobs or 0
        top = tuple(zip(ids[r][:k], values[r][1 : k + 1], strict=True))
        result[i] = TokenLogprobs(values[r][0], top)
    return result
