"""Next-token choice for a whole batch at once: greedy rows take the argmax, the others sample
with temperature, min-p, top-k and top-p, applied in that order (vLLM's), then typical-p.

Sampling is the Gumbel-max trick, as an exponential race: `argmax(logit / T - log E)`, with
E = -log U ~ Exp(1) and U uniform, is token j with probability softmax(logit / T)[j]. So a row
that truncates nothing needs neither a softmax nor a sort, and min-p is a threshold on the
scaled logits (`p ≥ min_p × p_max` is `logit / T ≥ max / T + log min_p`). Rows with top-k take
their k best with `topk`, which costs less than a sort at every k measured on the CPU
(benchmarks/sampler.py), and apply top-p among those; only rows with top-p and no top-k sort
their vocabulary (top-p needs the mass in order). Each kind of row is handled by a few tensor
ops for all its rows.

Noise: a row with a seed draws from its own `torch.Generator`, a count that depends only on its
own settings (the vocabulary, or its k under top-k), so its tokens depend only on its seed,
its settings and how many tokens it has drawn, whatever shares its batch. Rows without a seed
draw theirs in one call from the sampler's generator. The chosen tokens stay on the logits'
device; the engine copies them to the host once per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cached_property
from typing import Annotated

import torch
from pydantic import ConfigDict, Field, model_validator
from torch import Tensor

from kvctl.agent.model.processing import RequestRows
from kvctl.api import MAX_LOGPROBS, MaxTokens, SamplingFields

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's step: seeds of choices far apart
GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (vLLM's threshold): dividing logits by a smaller one only
overflows, and the distribution is already all on the top token."""


class SamplingParams(SamplingFields):
    """One request's sampling fields as the engine runs them: `SamplingFields` (each field's
    bounds, default and meaning, kvctl.api) and what the route decides, `max_tokens` and
    `logprobs` (how many top alternatives to report, None for none). Checked once, when made (a
    ValueError naming the field), and frozen.

    temperature below `GREEDY_BELOW` means greedy; top_k 0 or -1, top_p 1, typical_p 1 and min_p
    0 mean no truncation; `stop` strings end generation (the engine matches them on decoded
    text, and `include_stop_str_in_output` keeps the matched one, or the stop token's text);
    `ignore_eos` keeps generating past EOS; `skip_special_tokens` leaves special tokens' text
    out of the output. The logit processing fields (penalties, `logit_bias`,
    `allowed_token_ids`, `min_tokens`, `stop_token_ids`, `logprobs`) are applied by
    `kvctl.agent.model.processing`.
    """

    model_config = ConfigDict(frozen=True)

    max_tokens: MaxTokens = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @classmethod
    def of(cls, fields: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """A request body's sampling fields with its route's `max_tokens` and `logprobs`."""
        values = {name: getattr(fields, name) for name in SamplingFields.model_fields}
        return cls(**values, max_tokens=max_tokens, logprobs=logprobs)

    @model_validator(mode="after")
    def _min_tokens_within_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens {self.max_tokens}], "
                f"got {self.min_tokens}"
            )
        return self

    @cached_property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple, whichever form it was given in."""
        stop = self.stop
        return (stop,) if isinstance(stop, str) else tuple(stop or ())

    @cached_property
    def bias(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs, in id order."""
        return tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items()))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def top_k_limit(self) -> int | None:
        """The k of top-k, None for no limit."""
        return self.top_k if self.top_k > 0 else None

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before the choice (penalties, bias, allowed ids,
        min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.allowed_token_ids
            or self.min_tokens
        )

    def make_generator(
        self, device: torch.device | str = "cpu", choice: int = 0
    ) -> torch.Generator | None:
        """The request's own RNG on `device` (the logits' device), seeded from `seed`; None for
        greedy requests, which draw nothing, and for requests without a seed, which draw from
        the sampler's generator. Choice `choice` of a request with `n` > 1 gets its own stream
        (choice 0 is the seed's own), so the choices of a seeded request differ from each other
        and are the same on every run."""
        if self.greedy or self.seed is None:
            return None
        generator = torch.Generator(device=device)
        if choice == 0:
            generator.manual_seed(self.seed)
        else:
            generator.manual_seed((self.seed + choice * _GOLDEN_GAMMA) % (1 << 64))
        return generator


class Noise:
    """The random numbers of a group of rows: those without a generator first, drawing from
    the sampler's shared one in one call, then each seeded row from its own."""

    def __init__(
        self, shared: torch.Generator | None, generators: Sequence[torch.Generator | None]
    ) -> None:
        self._shared = shared
        self._generators = generators

    def uniform(self, counts: Sequence[int], device: torch.device) -> Tensor:
        """[rows, max(counts)] uniforms in [tiny, 1), row j drawing counts[j] values (the rest
        of its row is tiny). Never 0: log 0 would make a race's noise -inf."""
        tiny = torch.finfo(torch.float32).tiny
        width = max(counts)
        uniform = torch.empty(len(self._generators), width, device=device)
        shared = sum(g is None for g in self._generators)
        if shared:
            uniform[:shared].uniform_(tiny, 1, generator=self._shared)
        for j in range(shared, len(self._generators)):
            uniform[j, : counts[j]].uniform_(tiny, 1, generator=self._generators[j])
            if counts[j] < width:
                uniform[j, counts[j] :] = tiny  # past the row's own k: dropped anyway
        return uniform

    def race(self, counts: Sequence[int], device: torch.device) -> Tensor:
        """[rows, max(counts)] log E, E ~ Exp(1): `argmax(scaled logits - log E)` is the
        exponential race `argmax(p / E)`, the Gumbel-max trick."""
        return self.uniform(counts, device).log_().neg_().log_()  # E = -log U


class Sampler:
    """Chooses one token per row of a logits batch, each row by its own request's settings.

    It also holds what its engine's requests need across steps: `rows`, their rows for logits
    processing (`kvctl.agent.model.processing`), and the generator that rows without a seed draw
    from (one per device, seeded from the OS)."""

    def __init__(self) -> None:
        self.rows = RequestRows()
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> Tensor:
        """logits [B, vocab], one SamplingParams and one generator per row (None for greedy rows
        and rows without a seed) -> token ids LongTensor [B] on the logits' device."""
        if not len(params) == len(generators) == logits.shape[0]:
            raise ValueError(
                "the sampler needs one SamplingParams and one generator per logits row"
            )
        vocab = logits.shape[-1]
        plain: list[int] = []
        top_k: list[int] = []
        ordered: list[int] = []
        for i, p in enumerate(params):
            if p.greedy:
                continue
            k = p.top_k_limit
            if k is not None and k < vocab:
                top_k.append(i)
            elif p.top_p < 1 or p.typical_p < 1:
                ordered.append(i)
            else:
                plain.append(i)
        sampled = len(plain) + len(top_k) + len(ordered)
        if sampled < len(params):
            tokens = logits.argmax(dim=-1)
            if not sampled:
                return tokens
        else:
            tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        for rows, choose in ((plain, _plain), (top_k, _top_k), (ordered, _ordered)):
            if not rows:
                continue
            rows.sort(key=lambda i: generators[i] is not None)  # one draw for the unseeded
            noise = self._noise([generators[i] for i in rows], logits.device)
            if rows == list(range(len(params))):  # every row, in order: no copy
                tokens = choose(logits.float(), params, noise)
                continue
            index = torch.tensor(rows, device=logits.device)
            picked = choose(logits.index_select(0, index).float(), [params[i] for i in rows], noise)
            tokens.index_copy_(0, index, picked)
        return tokens

    def _noise(self, generators: Sequence[torch.Generator | None], device: torch.device) -> Noise:
        """The noise of rows whose generators are `generators`, those without one first."""
        shared = self._generator(device) if any(g is None for g in generators) else None
        return Noise(shared, generators)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
            self._generators[device].seed()
        return self._generators[device]


def _scales(params: Sequence[SamplingParams], device: torch.device) -> tuple[Tensor, Tensor]:
    """[R, 1] temperatures and [R, 1] log min_p (-inf where min_p is 0: no threshold)."""
    values = torch.tensor([[p.temperature, p.min_p] for p in params], device=device)
    return values[:, :1], values[:, 1:].log()


def _plain(logits: Tensor, params: Sequence[SamplingParams], noise: Noise) -> Tensor:
    """Rows that keep every token (but those min-p drops): inverse-CDF sampling, one uniform
    per row against the cumulative weights, instead of a race that draws one number per token.
    The same distribution at a fraction of the cost: the race took 17 ms for 8 rows of 262,144
    logits, this takes about 4 (docs/performance.md)."""
    temperature, log_min_p = _scales(params, logits.device)
    scaled = logits / temperature
    top = scaled.amax(dim=-1, keepdim=True)
    if any(p.min_p > 0 for p in params):
        scaled.masked_fill_(scaled < top + log_min_p, -math.inf)
    # unnormalised weights exp(x - max) in float32 (each within 1e-7 of exact), summed in
    # float64 so that every token keeps its own interval however long the vocabulary
    cumulative = scaled.sub_(top).exp_().double().cumsum_(dim=-1)  # [R, vocab]
    # a token of probability 0 spans no interval: `right` never lands on it
    point = noise.uniform([1] * len(params), logits.device).double() * cumulative[:, -1:]
    chosen = torch.searchsorted(cumulative, point, right=True).squeeze(1)  # [R]
    return chosen.clamp_(max=logits.shape[-1] - 1)


def _top_k(logits: Tensor, params: Sequence[SamplingParams], noise: Noise) -> Tensor:
    """Rows with top-k: their k best (a logit's rank does not depend on the temperature), then
    min-p, top-p among those k (all top-p ever keeps), and the race among what is left."""
    device = logits.device
    ks = [p.top_k for p in params]
    values, ids = logits.topk(max(ks), dim=-1)  # [R, kmax], most likely first
    temperature, log_min_p = _scales(params, device)
    values = values / temperature
    ranks = torch.arange(values.shape[-1], device=device)[None, :]
    drop = ranks >= torch.tensor(ks, device=device)[:, None]
    if any(p.min_p > 0 for p in params):
        drop |= values < values[:, :1] + log_min_p
    values = values.masked_fill(drop, -math.inf)
    if any(p.top_p < 1 for p in params):
        values = _top_p(values.flip(-1), params).flip(-1)
    if any(p.typical_p < 1 for p in params):
        values = _typical(values, params)
    choice = (values - noise.race(ks, device)).argmax(dim=-1, keepdim=True)
    return ids.gather(1, choice).squeeze(1)


def _ordered(logits: Tensor, params: Sequence[SamplingParams], noise: Noise) -> Tensor:
    """Rows with top-p or typical-p and no top-k: the whole vocabulary in ascending order,
    min-p, top-p, typical-p, then the race among the rest."""
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)  # [R, vocab] each
    temperature, log_min_p = _scales(params, logits.device)
    scaled = ascending / temperature
    if any(p.min_p > 0 for p in params):
        scaled = scaled.masked_fill(scaled < scaled[:, -1:] + log_min_p, -math.inf)
    scaled = _top_p(scaled, params)
    if any(p.typical_p < 1 for p in params):
        scaled = _typical(scaled, params)
    choice = (scaled - noise.race([vocab] * len(params), logits.device)).argmax(
        dim=-1, keepdim=True
    )
    return order.gather(1, choice).squeeze(1)


def _top_p(ascending: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Scaled logits in ascending order (-inf for tokens already dropped), top-p applied as
    transformers' `TopPLogitsWarper` computes it: drop the tokens whose cumulative probability
    from the least likely up is ≤ 1 - top_p; the most likely always stays."""
    top_p = torch.tensor([p.top_p for p in params], device=ascending.device)[:, None]
    drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    drop[:, -1] = False
    return ascending.masked_fill(drop, -math.inf)


def _typical(scaled: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Scaled logits in any order (-inf for tokens already dropped), typical-p applied as
    transformers' `TypicalLogitsWarper` computes it: rank the tokens by how far their surprise
    (-log p) is from the entropy, keep them in that order until the kept mass reaches typical_p
    (the token that crosses it included; the closest always stays). Rows at 1 are untouched."""
    mass = torch.tensor([p.typical_p for p in params], device=scaled.device)[:, None]
    log_p = scaled.log_softmax(dim=-1)
    p = log_p.exp()
    entropy = -(log_p * p).nansum(dim=-1, keepdim=True)  # -inf * 0: a dropped token adds 0
    distance = (-log_p - entropy).abs()
    ranked, order = distance.sort(dim=-1)
    last = (p.gather(1, order).cumsum(dim=-1) < mass).sum(dim=-1, keepdim=True)
    drop = distance > ranked.gather(1, last.clamp_(max=scaled.shape[-1] - 1))
    return scaled.masked_fill(drop & (mass < 1), -math.inf)
