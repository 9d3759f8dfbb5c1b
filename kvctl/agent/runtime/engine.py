"""The engine: a model decoding on the paged pool, one `step()` at a time.

A step, in order (docs/architecture.md, the runtime): schedule (decode tokens first, preempting
when pages run out, then prompt chunks within the token budget, adopting cached prefixes) → apply
copy-on-write copies → run the model on the flattened batch → sample for the requests whose
tokens are all computed → append the tokens and finish requests (EOS, stop string, max_tokens,
context length) → give the defragmenter its budget. Its `stats` are read when asked (the agent's
service publishes them). Requests join and leave between steps.

The engine is single-threaded on purpose: the pool, the storage and the page tables are touched
only from `step()` and the calls the agent makes between steps (defrag, resize), so no lock is
needed around them; readers use the immutable `EngineStats` snapshot.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvctl.agent.config import DEFAULT_LONG_PROMPT_TOKENS
from kvctl.agent.model.attention import BatchLayout, layer_attentions
from kvctl.agent.model.fused import fuse
from kvctl.agent.model.llama import LlamaModel
from kvctl.agent.model.processing import (
    TokenLogprobs,
    check_vocabulary,
    process_logits,
    token_logprobs,
)
from kvctl.agent.model.sampling import Sampler, SamplingParams
from kvctl.agent.model.tokenizer import Tokenizer
from kvctl.agent.pool import (
    AutoDefrag,
    Defragmenter,
    PagePool,
    PoolOccupancy,
    PoolResizer,
)
from kvctl.agent.pool.stats import PageStates
from kvctl.agent.pool.storage import KVStorage
from kvctl.agent.prefix import EVICTION_POLICIES, PrefixCache, PrefixIsolation
from kvctl.agent.runtime.choices import DeferredChoices
from kvctl.agent.runtime.detokenizer import IncrementalDetokenizer, OutputText
from kvctl.agent.runtime.grouped_cache import GroupedKVCache
from kvctl.agent.runtime.layer_groups import page_groups
from kvctl.agent.runtime.paged_cache import PagedKVCache, ReadPath
from kvctl.agent.runtime.prefix_ops import PrefixOperations
from kvctl.agent.runtime.request import FinishReason, Request, RequestStatus
from kvctl.agent.runtime.scheduler import (
    DEFAULT_MAX_BATCHED_TOKENS,
    ScheduledBatch,
    Scheduler,
    check_batch_limits,
)
from kvctl.agent.runtime.thread_owner import ThreadOwner, engine_only
from kvctl.agent.tiers import TieredStore, TierStats
from kvctl.settings import DefragSettings


@dataclass(frozen=True)
class EngineConfig:
    """Pool shape, batching limits and prefix reuse of one engine.

    `prefix_cache` turns prefix reuse on (`--no-prefix-cache` turns it off: every prompt is
    computed in full and nothing is cached); `eviction_policy` is one of `EVICTION_POLICIES`;
    `prefix_isolation` is "salt" (partition by model and cache salt) or "sampling" (also by the
    sampling settings).
    """

    device: str = "cpu"
    dtype: torch.dtype | None = None  # default: the model's parameters' dtype
    page_size: int = 16
    pool_pages: int = 512
    segment_pages: int = 128
    max_pool_pages: int | None = None
    min_pool_pages: int | None = None
    max_batch_seqs: int = 64
    max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS  # per step; prompts are cut to fit
    # prompts with more tokens than this left to compute are long (and always those over budget)
    long_prompt_tokens: int = DEFAULT_LONG_PROMPT_TOKENS
    # tokens per step for long prompts while requests decode; 0: no cap
    max_prefill_while_decoding: int = 0
    defrag: DefragSettings = field(default_factory=DefragSettings)
    prefix_cache: bool = True
    eviction_policy: str = "lru"
    prefix_isolation: str = "salt"
    decode_read_path: ReadPath = "auto"  # see `PagedKVCache`
    # sliding-window layers keep pages of their own and give back those their window left
    release_window_pages: bool = True
    cpu_kernels: bool = True  # the project's CPU kernels where they run (`kvctl.agent.kernels`)
    # tiers below the pool for evicted prefix pages (both need the prefix cache)
    host_tier_bytes: int = 0
    host_tier_policy: str = "lru"
    disk_tier_path: str | None = None
    disk_tier_bytes: int = 0
    disk_tier_policy: str = "lru"

    @property
    def tiered(self) -> bool:
        """Whether evicted prefix pages go to a host or disk tier."""
        return self.prefix_cache and (self.host_tier_bytes > 0 or self.disk_tier_path is not None)

    def __post_init__(self) -> None:
        for name in ("page_size", "pool_pages", "segment_pages", "max_batch_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        check_batch_limits(self.max_batch_seqs, self.max_batched_tokens)
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, "
                f"got {self.eviction_policy!r}"
            )
        for name in ("host_tier_policy", "disk_tier_policy"):
            if getattr(self, name) not in EVICTION_POLICIES:
                raise ValueError(
                    f"{name} must be one of {', '.join(EVICTION_POLICIES)}, "
                    f"got {getattr(self, name)!r}"
                )
        if self.host_tier_bytes < 0 or self.disk_tier_bytes < 0:
            raise ValueError("tier sizes must be 0 or more bytes")
        if self.disk_tier_path is not None and self.disk_tier_bytes < 1:
            raise ValueError("a disk tier needs a size (--disk-tier-size)")
        isolations = [i.value for i in PrefixIsolation]
        if self.prefix_isolation not in isolations:
            raise ValueError(
                f"prefix_isolation must be one of {', '.join(isolations)}, "
                f"got {self.prefix_isolation!r}"
            )


class WeightsUnloaded(RuntimeError):
    """The engine was asked to run a model whose weights a level-2 sleep dropped (a bug: a
    sleeping model's engine is never stepped)."""


class RequestRefused(ValueError):
    """A request the engine will not queue; nothing changed. `reason` labels the refusal in
    `kvctl_requests_rejected_total`."""

    reason = "invalid"


class RequestTooLarge(RequestRefused):
    """The prompt plus `max_tokens` can never fit: the model's context, or the whole pool.

    Admitting it would only end in a silent cut (or, before, a stall), so it is refused at
    arrival. `resize_to` is the pool size that would make room (None when the model's context,
    or the pool's `--max-pool-pages`, is what is exceeded)."""

    reason = "too_large"

    def __init__(self, problem: str, remedy: str, resize_to: int | None = None) -> None:
        super().__init__(f"{problem}; {remedy}")
        self.problem = problem
        self.remedy = remedy
        self.resize_to = resize_to

    def describe(self, kvctl: str = "kvctl") -> str:
        """The message with the resize command for this agent (`kvctl --agent URL`)."""
        if self.resize_to is None:
            return str(self)
        return (
            f"{self.problem}; make room with `{kvctl} pool resize --pages {self.resize_to}`, "
            f"or {self.remedy}"
        )


@dataclass(frozen=True)
class RequestSummary:
    """What a finished request's answer needs from it, copied on the engine thread, so the HTTP
    thread never reads the engine's `Request` (which the engine thread owns)."""

    output_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    finish_detail: str | None

    @classmethod
    def of(cls, request: Request) -> RequestSummary:
        return cls(
            tuple(request.output_ids),
            len(request.prompt_ids),
            request.cached_tokens,
            request.finish_detail,
        )


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one request, with the text it adds (possibly empty). The last
    event of a request has its finish reason and its summary."""

    request_id: str
    token_id: int | None  # None when a request ends without a new token
    text: str
    finish_reason: FinishReason | None
    summary: RequestSummary | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them


@dataclass(frozen=True)
class EngineStats:
    """What the engine looks like after a step: the pool and the scheduler, read together."""

    pool: PoolOccupancy  # the pool core's reading (kvctl.agent.api_views makes the API's)
    requests_running: int
    requests_waiting: int
    preemptions: int
    steps: int
    generated_tokens: int
    prompt_tokens: int
    prefix_queries_tokens: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_hits_tokens: int = 0  # of those, served from the cache
    prefix_evictions: Mapping[str, int] = field(default_factory=dict)  # pages, per policy
    prefix_cached_pages: int = 0  # pages the prefix cache holds (used by requests or cached)
    tiers: tuple[TierStats, ...] = ()  # the tiers below the pool, when configured
    prefill_seconds_per_token: float | None = None  # measured on prompt steps (PrefillRate)
    finished: Mapping[str, int] = field(default_factory=dict)  # requests, by finish reason
    oldest_queued_at: float | None = None  # engine clock; None when nothing waits
    last_progress_at: float = 0.0  # last step that admitted, produced or ended anything
    page_groups: int = 1  # page tables per request (`layer_groups`)
    window_pages: int = 0  # pages running requests' sliding-window groups hold
    window_released_pages: int = 0  # pages sliding windows gave back while requests ran
    token_slots_used: int = 0  # token slots of used pages that hold a token's K/V
    preemptions_by_reason: Mapping[str, int] = field(default_factory=dict)
    prefix_evictions_by_reason: Mapping[str, int] = field(default_factory=dict)  # pages

    @property
    def prefix_hit_ratio(self) -> float | None:
        """Prefix-cache hits / queries in tokens since start; None before the first query."""
        if not self.prefix_queries_tokens:
            return None
        return self.prefix_hits_tokens / self.prefix_queries_tokens

    @property
    def prefix_evictions_total(self) -> int:
        return sum(self.prefix_evictions.values())

    @property
    def prefix_hits_by_tier(self) -> dict[str, int]:
        """`prefix_hits_tokens` split by where the reused pages were: each hit token is
        counted in exactly one tier, so the values sum to `prefix_hits_tokens`."""
        below = {t.name: t.counters.hits_tokens for t in self.tiers}
        return {"device": self.prefix_hits_tokens - sum(below.values()), **below}


class Engine:
    """Runs requests to completion on a model whose KV cache lives in a `PagePool`."""

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer | None,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config = config or EngineConfig()
        self._model: LlamaModel | None = fuse(model, kernels=config.cpu_kernels)
        self.tokenizer = tokenizer
        self.model_config = mc = model.config
        # EOS comes from the checkpoint's config; a tokenizer is only needed for text
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids if tokenizer else mc.eos_token_ids)
        self.device = torch.device(config.device)
        dtype = config.dtype or next(model.parameters()).dtype
        segments = -(-config.pool_pages // config.segment_pages)
        self.groups = groups = page_groups(mc, config.release_window_pages)
        self.storage = KVStorage(
            segments,
            config.segment_pages,
            config.page_size,
            groups.size,
            mc.num_kv_heads,
            mc.head_dim,
            dtype,
            self.device,
        )
        self.pool = PagePool(
            segments * config.segment_pages,
            config.page_size,
            config.segment_pages,
            self.storage.bytes_per_page,
        )
        self.defragmenter = Defragmenter(self.pool, self.storage)
        self.auto_defrag = AutoDefrag(self.defragmenter, config.defrag, clock=clock)
        self.resizer = PoolResizer(
            self.pool,
            self.defragmenter,
            self.storage,
            min_pages=config.min_pool_pages,
            max_pages=config.max_pool_pages,
            promised=self.pages_promised,
        )
        reads = (self.pool, self.storage, config.decode_read_path, mc.num_heads, config.cpu_kernels)
        layers = layer_attentions(mc, model.attention_sinks())
        self.cache: PagedKVCache | GroupedKVCache = (
            GroupedKVCache(groups, *reads, layers) if groups.split else PagedKVCache(*reads, layers)
        )
        self.prefix_cache = (
            PrefixCache(
                self.pool,
                config.eviction_policy,
                mc.name,
                config.prefix_isolation,
                groups.windows if groups.releases else (),
            )
            if config.prefix_cache
            else None
        )
        self.tiers = (
            TieredStore(
                self.storage,
                config.host_tier_bytes,
                config.disk_tier_path,
                config.disk_tier_bytes,
                config.host_tier_policy,
                config.disk_tier_policy,
            )
            if config.tiered and self.prefix_cache is not None
            else None
        )
        if self.tiers is not None and self.prefix_cache is not None:
            self.prefix_cache.spill = self.tiers.store_many
        self.scheduler = Scheduler(
            self.pool,
            config.max_batch_seqs,
            config.max_batched_tokens,
            self.prefix_cache,
            clock,
            prefill_while_decoding=config.max_prefill_while_decoding,
            long_prompt_tokens=config.long_prompt_tokens,
            tiers=self.tiers,
            groups=groups,
        )
        self.resizer.pinned = self._pinned_pages
        self.prefix_ops = (
            PrefixOperations(self.scheduler, self.prefix_cache, self.tiers)
            if self.prefix_cache is not None
            else None
        )
        self.prefill_rate = PrefillRate()
        self.clock = clock
        self.finished: Counter[str] = Counter()
        self.last_progress_at = clock()
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.choices = DeferredChoices()
        self._logprobs: dict[str, TokenLogprobs] = {}  # this step's, by request id
        self._arrivals = itertools.count()
        self._steps = 0
        self._generated = 0
        self._prompt_tokens = 0
        self.owner = ThreadOwner()  # the agent's engine thread claims it while it runs

    # ---- requests -----------------------------------------------------------------------

    @engine_only
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        first_choice: str | None = None,
        choice: int = 0,
    ) -> Request:
        """Queue a request; raises ValueError for an empty prompt, unknown token ids or an empty
        `cache_salt`, and `RequestTooLarge` when the prompt plus `max_tokens` exceeds the model's
        context or could never fit the pool.

        Requests with different `cache_salt` never share prefix-cache pages. Choice `choice` > 0
        of a request with `n` > 1 names its `first_choice` (same prompt, params and salt): it
        waits until that one has computed the prompt, then adopts its pages (`DeferredChoices`)."""
        params = params or SamplingParams()
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string when given")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: send the prompt as token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        self._check_prompt(ids, params)
        check_vocabulary(params, self.model_config.vocab_size)
        arrival = next(self._arrivals)
        request_id = request_id or f"req-{arrival}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id,
            ids,
            params,
            arrival,
            generator=params.make_generator(self.device, choice),
            cache_salt=cache_salt,
        )
        self.requests[request_id] = request
        first = self.requests.get(first_choice) if first_choice is not None else None
        if first is not None and self.prefix_cache is not None:
            self.choices.defer(first, request)  # queued after the next step
        else:
            self.scheduler.add(request)
        self._prompt_tokens += len(ids)
        return request

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        total = len(ids) + params.max_tokens
        what = f"the prompt ({len(ids)} tokens) plus max_tokens {params.max_tokens}"
        limit = self.model_config.max_context_len
        if total > limit:
            raise RequestTooLarge(
                f"{what} exceeds the model's context of {limit} tokens",
                "shorten the prompt or lower max_tokens",
            )
        pool, needed = self.pool, self.scheduler.pages.pages_for(total)
        if needed > self.scheduler.most_pages():
            problem = (
                f"{what} needs {needed} pages of {pool.page_size} tokens and the pool holds "
                f"{pool.capacity}{self.scheduler.pinned_note()}"
            )
            needed += self.scheduler.pins.pinned_pages
            if self.scheduler.reachable_pages is not None:  # a pool in a budget shared
                raise RequestTooLarge(
                    f"{problem}, at most {self.scheduler.most_pages()} within the KV budget it "
                    "shares with the other models' pools",
                    "restart the agent with a larger --kv-budget, or shorten the prompt or "
                    "lower max_tokens",
                )
            ceiling = self.resizer.max_pages
            if ceiling is not None and needed > ceiling:
                raise RequestTooLarge(
                    f"{problem}, at most {ceiling} after growth",
                    f"restart the agent with --max-pool-pages {needed} or more, or shorten the "
                    "prompt or lower max_tokens",
                )
            raise RequestTooLarge(
                problem,
                "shorten the prompt or lower max_tokens",
                self.resizer.round_to_segments(needed),
            )

    # ---- weights (a model put to sleep and woken) ------------------------------------------

    @property
    def model(self) -> LlamaModel:
        """The model in its serving form; `WeightsUnloaded` while a sleep dropped it."""
        if self._model is None:
            raise WeightsUnloaded("the model's weights are unloaded (it sleeps at level 2)")
        return self._model

    @property
    def weights_loaded(self) -> bool:
        return self._model is not None

    def weights_bytes(self, device: torch.device | None = None) -> int:
        """Bytes of the model's parameters and buffers (on `device` only, when given)."""
        if self._model is None:
            return 0
        tensors = [*self._model.parameters(), *self._model.buffers()]
        return sum(
            t.numel() * t.element_size() for t in tensors if device is None or t.device == device
        )

    @engine_only
    def unload_weights(self) -> None:
        """Drop the model (level-2 sleep); nothing may step until `load_weights`."""
        self._model = None

    def serving_form(self, model: LlamaModel) -> LlamaModel:
        """`model` rewritten as this engine serves it (`fuse`); any thread may call it, for a
        model no engine runs yet."""
        return fuse(model, kernels=self.config.cpu_kernels)

    @engine_only
    def load_weights(self, model: LlamaModel) -> None:
        """Serve `model` (the same checkpoint, loaded again) from the next step on."""
        self._model = self.serving_form(model)

    @engine_only
    def move_weights(self, device: torch.device) -> None:
        """Move the model's weights to `device` (a level-1 sleep keeps them in host memory)."""
        self.model.to(device)

    def _pinned_pages(self) -> int:
        return self.scheduler.pins.pinned_pages

    def pages_promised(self) -> int:
        """The most pages any unfinished request may need to reach its `max_tokens`: the
        pool must not shrink below it (every admitted request can then always finish)."""
        pages_for = self.scheduler.pages.pages_for
        return max(
            (pages_for(len(r.prompt_ids) + r.params.max_tokens) for r in self.requests.values()),
            default=0,
        )

    @engine_only
    def abort(self, request_id: str, detail: str = "the client went away") -> Request:
        """Stop a request now; its pages are freed before the next step."""
        request = self.requests[request_id]
        if not request.finished:
            request.finish_reason = FinishReason.ABORT
            request.finish_detail = detail
            self.scheduler.finish(request)
            self.requests.pop(request_id)
            self.finished[FinishReason.ABORT] += 1
        return request

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.choices)

    @engine_only
    def set_eviction_policy(self, name: str) -> None:
        """Switch the prefix cache's eviction policy now (ValueError for an unknown name)."""
        if self.prefix_cache is None:
            raise ValueError("the prefix cache is off (--no-prefix-cache): no eviction policy")
        self.prefix_cache.set_policy(name)

    # ---- the step -----------------------------------------------------------------------

    @engine_only
    def step(self) -> list[TokenEvent]:
        """Run one scheduling step; return the tokens it produced and the requests it ended."""
        batch = self.scheduler.schedule()
        events = [self._end(r) for r in batch.ended] if batch is not None else []
        if batch is not None and batch.requests:
            if batch.copies:
                self.storage.copy_pages(
                    [c.src for c in batch.copies], [c.dst for c in batch.copies]
                )
                self.scheduler.copies_applied()
            for load in batch.loads:
                self.storage.fill_pages(load.pages, load.data)
            sampled = batch.sampled_requests
            next_tokens = self._run_model(batch, sampled)
            events.extend(self._postprocess(sampled, next_tokens))
        self._release_choices()
        self.auto_defrag.tick()
        self._steps += 1
        if batch is not None:
            self.last_progress_at = self.clock()
        for event in events:
            if event.finish_reason is not None:
                self.finished[event.finish_reason] += 1
        return events

    def _release_choices(self) -> None:
        """Queue the choices whose first choice has computed the prompt, its pages offered to
        the prefix cache first so that they adopt them."""
        for first, followers in self.choices.ready():
            if first.status is RequestStatus.RUNNING:
                self.scheduler.share_computed(first)
            for follower in followers:
                self.scheduler.add(follower)

    def _choose(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """Each row's next token after its processing (penalties, bias, allowed ids,
        `min_tokens`), the whole batch at once; the tokens reach the host in one copy, and the
        log-probs the requests asked for are kept for their events."""
        params = [r.params for r in requests]
        processed = process_logits(logits, requests, self.eos_token_ids, self.sampler.rows)
        chosen = self.sampler(processed, params, [r.generator for r in requests])
        for request, logprobs in zip(requests, token_logprobs(logits, chosen, params), strict=True):
            if logprobs is not None:
                self._logprobs[request.request_id] = logprobs
        return chosen.tolist()

    def _run_model(self, batch: ScheduledBatch, sampled: Sequence[Request]) -> list[int]:
        """Compute the step's tokens (decode tokens and prompt chunks in one forward) and return
        the next token of each of `sampled` (`batch.sampled_requests`); every request's
        `num_computed` advances by its tokens, whose K/V are in the pool from now on."""
        requests, computed, new = batch.requests, batch.computed, batch.new_tokens
        layout = BatchLayout(tuple(r.seq_id for r in requests), tuple(computed), tuple(new))
        decode = len(requests) == sum(new)  # one token each
        if decode:
            token_ids = [_token_at(r, i) for r, i in zip(requests, computed, strict=True)]
            positions = torch.tensor(computed, dtype=torch.long, device=self.device)
        else:
            token_ids = []
            for request, start, count in zip(requests, computed, new, strict=True):
                token_ids += _token_slice(request, start, count)
            positions = layout.positions(self.device)
        self.cache.begin_step(layout)
        started = time.perf_counter()
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=self.device), positions, self.cache
        )
        for request, count in zip(requests, new, strict=True):
            request.num_computed += count
        self.scheduler.step_computed(batch)
        if not sampled:
            return []  # only chunks short of their prompt's end: nothing to sample
        if not decode or len(sampled) != len(requests):
            rows = [
                o + n - 1 for o, n, s in zip(layout.offsets, new, batch.sampled, strict=True) if s
            ]
            hidden = hidden.index_select(0, torch.tensor(rows, device=self.device))
        chosen = self._choose(self.model.logits(hidden), sampled)
        if not decode:  # timed once the tokens reached the host: a GPU's forward has finished
            self.prefill_rate.observe(len(token_ids), time.perf_counter() - started)
        return chosen

    def _postprocess(self, sampled: Sequence[Request], next_tokens: list[int]) -> list[TokenEvent]:
        events = []
        logprobs = self._logprobs
        self._generated += len(next_tokens)
        for request, token in zip(sampled, next_tokens, strict=True):
            request.num_computed = request.num_tokens  # the sampled token's K/V come next step
            request.output_ids.append(token)
            output = request.output_text or self._output_text(request)
            text = output.append(token)
            reason = self._check_finish(request, token)
            summary = None
            if reason is not None:
                text += output.finish()
                request.finish_reason = reason
                self.scheduler.finish(request)
                self.requests.pop(request.request_id, None)
                summary = RequestSummary.of(request)
            token_logprobs = logprobs.pop(request.request_id, None) if logprobs else None
            events.append(
                TokenEvent(request.request_id, token, text, reason, summary, token_logprobs)
            )
        return events

    def _end(self, request: Request) -> TokenEvent:
        self.requests.pop(request.request_id, None)
        text = self._output_text(request).finish()
        return TokenEvent(
            request.request_id, None, text, request.finish_reason, RequestSummary.of(request)
        )

    def _check_finish(self, request: Request, token: int) -> FinishReason | None:
        """Why the request ends after `token`, if it does: EOS, a stop string (its text is cut
        before it, as in OpenAI's API), `max_tokens` or the model's context."""
        params = request.params
        if token in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if params.stop_token_ids and token in params.stop_token_ids:
            return FinishReason.STOP
        if self._output_text(request).stopped:
            return FinishReason.STOP
        if len(request.output_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.model_config.max_context_len:
            return FinishReason.LENGTH
        return None

    def _output_text(self, request: Request) -> OutputText:
        """The request's output text, made on first use. The token that ends a request (EOS,
        unless `ignore_eos`, or one of `stop_token_ids`) is left out of the text, as a matched
        stop string is, unless `include_stop_str_in_output`; while special tokens are skipped,
        EOS never has text, even when `ignore_eos` keeps generating past it."""
        if request.output_text is None:
            params = request.params
            eos = set() if params.ignore_eos else self.eos_token_ids
            stop_ids = params.stop_token_ids or ()
            skip = set() if params.include_stop_str_in_output else {*stop_ids, *eos}
            if params.skip_special_tokens:
                skip |= self.eos_token_ids
            detokenizer = (
                IncrementalDetokenizer(self.tokenizer, skip, params.skip_special_tokens)
                if self.tokenizer is not None
                else None
            )
            request.output_text = OutputText(
                detokenizer, params.stop_strings, params.include_stop_str_in_output
            )
        return request.output_text

    # ---- reading ------------------------------------------------------------------------

    @property
    @engine_only
    def stats(self) -> EngineStats:
        """The pool and the scheduler read together, built when asked (not on every step)."""
        prefix = self.prefix_cache.stats() if self.prefix_cache is not None else None
        tiers = tuple(self.tiers.stats()) if self.tiers is not None else ()
        return EngineStats(
            pool=self.pool.stats(),
            requests_running=len(self.scheduler.running),
            requests_waiting=len(self.scheduler.waiting),
            preemptions=self.scheduler.preemptions,
            steps=self._steps,
            generated_tokens=self._generated,
            prompt_tokens=self._prompt_tokens,
            prefix_queries_tokens=prefix.queries_tokens if prefix else 0,
            prefix_hits_tokens=(prefix.hits_tokens if prefix else 0)
            + sum(t.counters.hits_tokens for t in tiers),
            prefix_evictions=prefix.evictions if prefix else {},
            prefix_cached_pages=prefix.held_pages if prefix else 0,
            tiers=tiers,
            prefill_seconds_per_token=self.prefill_rate.seconds_per_token,
            finished=dict(self.finished),
            oldest_queued_at=self.scheduler.oldest_queued_at(),
            last_progress_at=self.last_progress_at,
            page_groups=self.groups.count,
            window_pages=self.scheduler.window_pages(),
            window_released_pages=self.scheduler.window_released,
            token_slots_used=self._token_slots_used(),
            preemptions_by_reason=dict(self.scheduler.preemptions_by_reason),
            prefix_evictions_by_reason=(
                dict(self.prefix_cache.evictions_by_reason) if self.prefix_cache else {}
            ),
        )

    def _token_slots_used(self) -> int:
        """The used pages' token slots less the empty ones, which are all at the end of some
        table (a partly filled last page, pages taken ahead of the tokens): shared pages are
        whole, and a pin's pages are full."""
        page_size, pages = self.pool.page_size, self.scheduler.pages
        empty = 0
        for request in self.scheduler.running:
            for table in pages.tables(request.seq_id):
                places = (table.dropped + len(table.pages)) * page_size
                empty += places - min(request.num_computed, table.num_tokens, places)
        return self.pool.used_pages * page_size - empty

    def page_states(self) -> PageStates:
        """The pool's page states, the pages of sliding-window groups marked apart."""
        states = self.pool.pages.states()
        pages = self.scheduler.window_page_ids()
        if not pages:
            return states
        window = bytearray(states.capacity)
        for page in pages:
            window[page] = 1
        return dataclasses.replace(states, window=bytes(window))

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None
    ) -> list[Request]:
        """Run `prompts` to completion (for tests, benchmarks and scripts)."""
        requests = [self.add_request(p, params) for p in prompts]
        while any(r.status is not RequestStatus.FINISHED for r in requests):
            self.step()
        return requests


def _token_at(request: Request, index: int) -> int:
    """Token `index` of prompt + output (a one-token step may be a prompt's last chunk)."""
    prompt = request.prompt_ids
    return prompt[index] if index < len(prompt) else request.output_ids[index - len(prompt)]


def _token_slice(request: Request, start: int, count: int) -> list[int]:
    """Tokens `start : start + count` of prompt + output, without joining the two lists (a
    decode step would otherwise copy every running request's whole prompt)."""
    prompt = request.prompt_ids
    if start >= len(prompt):
        start -= len(prompt)
        return request.output_ids[start : start + count]
    return request.token_ids[start : start + count]


class PrefillRate:
    """Seconds per token of the model's prompt steps, averaged over recent steps: what a
    prefix costs to recompute, to hold a tier's load time against.

    Only steps with at least `MIN_TOKENS` new tokens that sample a token count (shorter ones
    are mostly fixed per-step cost), timed from the forward's start until the sampled tokens
    reach the host: on a GPU the forward runs asynchronously, and only that copy waits for it,
    so timing the forward's call alone would measure its launch."""

    MIN_TOKENS = 64
    WEIGHT = 0.2  # of the newest step in the moving average

    def __init__(self) -> None:
        self.seconds_per_token: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < self.MIN_TOKENS:
            return
        rate = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else old + self.WEIGHT * (rate - old)
