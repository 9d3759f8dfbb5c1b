"""Next-token choice: greedy, or temperature + top-k + top-p sampling with a per-request RNG.

Each sampled row draws its noise from its own `torch.Generator`, exactly `vocab` values per step,
so a request with a seed gets the same tokens whatever else shares its batch: the noise it sees
depends only on its seed and how many tokens it has sampled.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvctl.agent.model.processing import check_processing

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's step: seeds of choices far apart


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, with OpenAI's defaults. Invalid values raise ValueError.

    temperature 0 means greedy; top_k 0 or -1 and top_p 1.0 mean no truncation; `stop` strings end
    generation (the engine matches them on decoded text); `ignore_eos` keeps generating past EOS.
    The logit processing fields (penalties, `logit_bias` as (token id, bias) pairs, `min_tokens`,
    `stop_token_ids`, `logprobs`: how many top alternatives to report, None for none) are
    checked and applied by `kvctl.agent.runtime.logits`.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] | list[str] | str = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        _check_number("temperature", self.temperature, "a number ≥ 0 (0 means greedy)")
        if self.temperature < 0:
            raise ValueError(f"temperature must be ≥ 0 (0 means greedy), got {self.temperature}")
        _check_number("top_p", self.top_p, "a number in (0, 1]")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an integer ≥ 1, or 0 / -1 for no limit; got {self.top_k!r}"
            )
        if self.seed is not None and (
            not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX
        ):
            raise ValueError(
                f"seed must be an integer in [-2**63, 2**64 - 1] or null, got {self.seed!r}"
            )
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer ≥ 1, got {self.max_tokens!r}")
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {list(stop)!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        check_processing(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before the choice (penalties, bias, min_tokens)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.logit_bias or self.min_tokens
        )

    def make_generator(
        self, device: torch.device | str = "cpu", choice: int = 0
    ) -> torch.Generator | None:
        """The request's RNG on `device` (the logits' device): seeded from `seed`, or randomly
        when there is none; None for greedy requests, which draw nothing. Choice `choice` of a
        request with `n` > 1 gets its own stream (choice 0 is the seed's own), so the choices
        of a seeded request differ from each other and are the same on every run."""
        if self.greedy:
            return None
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        elif choice == 0:
            generator.manual_seed(self.seed)
        else:
            generator.manual_seed((self.seed + choice * _GOLDEN_GAMMA) % (1 << 64))
        return generator


class Sampler:
    """Chooses one token per row of a logits batch, each row by its own request's settings."""

    def __call__(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> Tensor:
        """logits [B, vocab] (float32), one SamplingParams and one generator per row (None for
        greedy rows) -> token ids LongTensor [B]."""
        if not len(params) == len(generators) == logits.shape[0]:
            raise ValueError(
                "the sampler needs one SamplingParams and one generator per logits row"
            )
        tokens = logits.argmax(dim=-1)  # [B]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            picked = sample_rows(
                logits.index_select(0, index),
                [params[i] for i in rows],
                [generators[i] for i in rows],
            )
            tokens[index] = picked
        return tokens


def sample_rows(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> Tensor:
    """logits [R, vocab] of non-greedy rows -> sampled ids [R].

    Works in descending-sorted order (stable, so ties keep the lower id first, like argmax): top-k
    drops ranks ≥ k, top-p drops tokens once the mass before them exceeds top_p (the first token
    always stays), then an exponential race `argmax(p / E)`, E ~ Exp(1) from the row's generator,
    picks a token with probability p.
    """
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=device)  # [R]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)  # [R]
    sorted_logits, order = (logits.float() / temperature[:, None]).sort(
        dim=-1, descending=True, stable=True
    )  # [R, vocab] each
    ranks = torch.arange(vocab, device=device)[None, :]  # [1, vocab]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], -math.inf)
    probs = sorted_logits.softmax(dim=-1)  # [R, vocab]
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before > top_p[:, None], 0.0)
    noise = torch.stack([_exponential(vocab, g, device) for g in generators])  # [R, vocab]
    choice = (probs / noise).argmax(dim=-1, keepdim=True)  # [R, 1]
    return order.gather(1, choice).squeeze(1)


def _exponential(n: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """n draws of Exp(1), kept above zero so that p / E is never 0 / 0."""
    noise = torch.empty(n, device=device).exponential_(generator=generator)
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(name: str, value: object, expected: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
