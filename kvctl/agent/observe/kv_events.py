"""The prefix cache's page events in vLLM's KV-events wire format (docs/kv-events.md).

A scorer that routes by prefix (llm-d's) learns which pages each vLLM pod holds from that pod's
events; an agent publishing the same stream shares traffic with vLLM pods. The wire is vLLM's
`ZmqEventPublisher`: a PUB socket sends `(topic, 8-byte big-endian sequence number, msgpack
KVEventBatch)`, one batch per engine step; an optional ROUTER socket replays the batches it
still keeps from a sequence number, then an end marker.

Pages are named by the tiers' page digests (`kvctl.agent.tiers.page_keys`: a BLAKE2b chain over
the partition, the storage layout and the tokens), sent as the digest's last 8 bytes read as a
big-endian integer: what vLLM sends by default and what llm-d reads from any hash. So a page
keeps its name from the device down to disk, and agents with the same model and layout name the
same prompt alike. Pages of salted partitions are never published (a tenant's tokens would go
out to every subscriber).

The engine thread only builds small structs and puts each step's batch on a bounded queue (a
full queue drops the batch and counts it); a thread of its own owns the sockets, encodes and
sends. That thread sleeps in a poll on the replay socket and a wake-up pipe the engine thread
writes to, and each pass does a bounded amount of each kind of work: a burst of replay requests
is drained at socket speed without holding back the live batches, and cannot starve a request
that arrives behind it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import threading
import time
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import msgspec
import zmq

from kvctl.agent.config import zmq_endpoint_binds
from kvctl.agent.prefix.prefix_cache import IsolationKey, Spilled
from kvctl.agent.tiers.page_keys import layout_of, page_digests, root_digest

log = logging.getLogger("kvctl.agent.observe.kv_events")

MEDIUM_GPU = "GPU"  # the device pool, as vLLM names its own (whatever the device)
TIER_MEDIA = {"host": "CPU", "disk": "STORAGE"}  # vLLM's MEDIUM_CPU and MEDIUM_STORAGE
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker, as vLLM's
BUFFER_STEPS = 10_000  # batches kept for replay (vLLM's buffer_steps)
HWM = 100_000  # the PUB socket's high-water mark (vLLM's hwm)
MAX_QUEUE_SIZE = 100_000  # batches waiting for the sending thread (vLLM's max_queue_size)
IDLE_FLUSH_S = 0.1  # events of admin commands between steps go out within this
IDLE_POLL_MS = 50  # how often an idle sending thread looks for such events
CLOSE_TIMEOUT_S = 1.0
BATCHES_PER_PASS = 1000
"""Queued batches sent in one pass of the sending thread before the replay socket is read."""
REPLAY_READS_PER_PASS = 1000
"""Replay requests read in one pass: a burst is drained at socket speed (reading a malformed
request costs a receive), while the live batches still go out between bursts."""
REPLAY_ANSWERS_PER_PASS = 16
"""Well-formed requests answered in one pass: each answer may be the whole buffer."""
REPLAY_MAX_FRAME = 256
"""Largest frame of a replay request (a request's are 0 and 8 bytes): ZMQ disconnects a peer
that sends more, so a flood cannot fill memory with large messages."""
_ROOTS_KEPT = 4096  # partitions whose root digest is remembered

_MEDIUM_BITS = {MEDIUM_GPU: 1, "CPU": 2, "STORAGE": 4}


# ---- the wire: vLLM 0.32's structs, field for field ----------------------------------------


class EventBatch(
    msgspec.Struct,
    array_like=True,
    omit_defaults=True,
    gc=False,
):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(
    msgspec.Struct,
    omit_defaults=True,
    gc=False,
    tag=True,
):
    """Tagged by class name under `type`, as vLLM's: the names are part of the format."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


AnyKVEvent = BlockStored | BlockRemoved | AllBlocksCleared
"""One event as sent (the tagged union a reader decodes)."""


class KVEventBatch(EventBatch):
    events: list[AnyKVEvent]


def wire_hash(digest: bytes) -> int:
    """A page digest as sent: its last 8 bytes, big-endian (vLLM's int hashes, llm-d's keys)."""
    return int.from_bytes(digest[-8:], "big")


# ---- one engine's pages -------------------------------------------------------------------


class _Page:
    """What a published page's later events need: its parent, its tokens, where it is."""

    __slots__ = ("media", "parent", "tokens")

    def __init__(self, parent: int | None, tokens: array) -> None:
        self.parent = parent
        self.tokens = tokens
        self.media = 0


class PageEventStream:
    """One engine's events: the prefix cache's and the tiers' observer, on the engine thread.

    Every published page is remembered (parent, tokens as uint32, the media holding it) so that
    a tier storing it later sends a BlockStored as self-describing as the device's; a page no
    medium holds is forgotten at the end of the step, once a move between tiers (removed from
    one, stored in the next) is over.
    """

    def __init__(
        self,
        submit: Callable[[bytes, list[AnyKVEvent]], None],
        topic: str,
        page_size: int,
        layout: str,
    ) -> None:
        self._submit = submit
        self.topic = topic
        self._topic = topic.encode()
        self.page_size = page_size
        self.layout = layout
        self._roots: dict[IsolationKey, bytes] = {}
        self._pending: list[AnyKVEvent] = []
        self._pages: dict[int, _Page] = {}
        self._unheld: set[int] = set()

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def _hashes(self, key: IsolationKey, tokens: Sequence[int], pages: int) -> list[int]:
        root = self._roots.get(key)
        if root is None:
            if len(self._roots) >= _ROOTS_KEPT:
                self._roots.clear()
            root = self._roots[key] = root_digest(key, self.layout)
        return [wire_hash(d) for d in page_digests(root, tokens, self.page_size, pages)]

    # -- the prefix cache (`PageEvents`)

    def stored(self, key: IsolationKey, tokens: Sequence[int], first_page: int, pages: int) -> None:
        if key.salt is not None:
            return  # isolated: never published
        size = self.page_size
        hashes = self._hashes(key, tokens, pages)
        parent = hashes[first_page - 1] if first_page else None
        new = hashes[first_page:]
        known = self._pages
        for k, page_hash in enumerate(new, first_page):
            page = known.get(page_hash)
            if page is None:
                page_tokens = array("I", tokens[k * size : (k + 1) * size])
                page = known[page_hash] = _Page(hashes[k - 1] if k else None, page_tokens)
            page.media |= 1
        self._pending.append(
            BlockStored(
                block_hashes=new,
                parent_block_hash=parent,
                token_ids=list(tokens[first_page * size : pages * size]),
                block_size=size,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=None,
                group_idx=0,
            )
        )

    def removed(self, runs: list[Spilled]) -> None:
        for run in runs:
            if run.key.salt is not None or not run.pages:
                continue
            last = run.first_page + len(run.pages)
            gone = self._hashes(run.key, run.tokens, last)[run.first_page :]
            self._left(gone, 1)
            self._pending.append(BlockRemoved(block_hashes=gone, medium=MEDIUM_GPU, group_idx=0))

    # -- the tiers (`TierIndex.on_change`)

    def tier_changed(self, medium: str, digests: list[bytes], stored: bool) -> None:
        """Pages a tier took or let go; only pages published from the device are followed."""
        known = self._pages
        hashes = [h for h in map(wire_hash, digests) if h in known]
        if not hashes:
            return
        if not stored:
            self._left(hashes, _MEDIUM_BITS[medium])
            last = self._pending[-1] if self._pending else None
            if isinstance(last, BlockRemoved) and last.medium == medium:
                last.block_hashes.extend(hashes)  # a tier lets its victims go one by one
            else:
                self._pending.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0))
            return
        bit = _MEDIUM_BITS[medium]
        run: list[int] = []
        for page_hash in hashes:  # a chain's pages in order make one event
            known[page_hash].media |= bit
            if run and known[page_hash].parent != run[-1]:
                self._stored_run(run, medium)
                run = []
            run.append(page_hash)
        self._stored_run(run, medium)

    def _stored_run(self, run: list[int], medium: str) -> None:
        pages = [self._pages[h] for h in run]
        tokens: list[int] = []
        for page in pages:
            tokens.extend(page.tokens)
        self._pending.append(
            BlockStored(
                block_hashes=run,
                parent_block_hash=pages[0].parent,
                token_ids=tokens,
                block_size=self.page_size,
                lora_id=None,
                medium=medium,
                lora_name=None,
                group_idx=0,
            )
        )

    def _left(self, hashes: list[int], bit: int) -> None:
        known = self._pages
        for page_hash in hashes:
            page = known.get(page_hash)
            if page is not None:
                page.media &= ~bit
                if not page.media:
                    self._unheld.add(page_hash)

    # -- batches

    def cleared(self) -> None:
        """Nothing is cached any more (start, stop): AllBlocksCleared, and forget every page."""
        self._pending.append(AllBlocksCleared())
        self._pages.clear()
        self._unheld.clear()

    def end_step(self) -> None:
        """Send this step's events as one batch and forget the pages no medium holds."""
        if self._unheld:
            known = self._pages
            for page_hash in self._unheld:
                page = known.get(page_hash)
                if page is not None and not page.media:
                    del known[page_hash]
            self._unheld.clear()
        if self._pending:
            events, self._pending = self._pending, []
            self._submit(self._topic, events)


# ---- the publisher ------------------------------------------------------------------------


class KVEventPublisher:
    """The sockets, sequence numbers, queue and replay buffer shared by every pool's stream.

    A sequence number is taken when the engine thread hands a batch over, so a batch the full
    queue drops leaves a gap a consumer can see (replay cannot fill it: it was never kept).
    `dropped_batches` / `dropped_events` count those; the PUB socket's own high-water mark drops
    silently, as vLLM's does.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        buffer_steps: int = BUFFER_STEPS,
        hwm: int = HWM,
        max_queue_size: int = MAX_QUEUE_SIZE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self.streams: list[PageEventStream] = []
        self.dropped_batches = 0
        self.dropped_events = 0
        self.published_batches = 0
        self.ignored_replay_requests = 0
        self._queue: queue.Queue[tuple[bytes, int, KVEventBatch] | None] = queue.Queue(
            maxsize=max_queue_size
        )
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._wake_recv, self._wake_send = socket.socketpair()
        self._wake_recv.setblocking(False)
        self._wake_send.setblocking(False)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(hwm)
            self.endpoint = _open(self._pub, endpoint)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_FRAME)
                self.replay_endpoint = _open(self._replay, replay_endpoint)
        except (zmq.ZMQError, ValueError) as error:
            self._close_sockets()
            raise ValueError(f"kv events: {error}") from None
        self._thread = threading.Thread(target=self._run, name="kvctl-kv-events", daemon=True)
        self._running = False
        self._request_flush: Callable[[Callable[[], None]], object] | None = None
        self._flush_asked = False

    @property
    def topics(self) -> list[str]:
        return [s.topic for s in self.streams]

    # ---- wiring (start-up, before the engine thread runs)

    def attach(self, engine: Any, topic: str) -> PageEventStream:
        """Follow `engine`'s prefix cache and tiers under `topic`, one batch per `step()`."""
        cache = engine.prefix_cache
        if cache is None:
            raise ValueError("kv events need the prefix cache")
        storage = engine.storage
        layout = (
            engine.tiers.layout
            if engine.tiers is not None
            else layout_of(
                storage.num_layers,
                storage.num_kv_heads,
                storage.head_dim,
                str(storage.dtype).removeprefix("torch."),
                storage.page_size,
            )
        )
        stream = PageEventStream(self.submit, topic, cache.page_size, layout)
        cache.events = stream
        if engine.tiers is not None:
            for tier in engine.tiers.tiers:
                tier.index.on_change = partial(stream.tier_changed, TIER_MEDIA[tier.name])
        step = engine.step

        def step_and_publish() -> Any:
            try:
                return step()
            finally:
                stream.end_step()

        engine.step = step_and_publish
        self.streams.append(stream)
        stream.cleared()  # a new process caches nothing: consumers drop what they had
        stream.end_step()
        return stream

    def start(self, call_on_engine: Callable[[Callable[[], None]], object] | None = None) -> None:
        """Start sending; `call_on_engine(fn)` runs `fn` between steps (`AgentService.call`),
        for events recorded outside a step (admin commands) while no step runs."""
        self._request_flush = call_on_engine
        self._running = True
        self._thread.start()

    # ---- the engine thread

    def submit(self, topic: bytes, events: list[AnyKVEvent]) -> None:
        """Hand one step's events over; never blocks (a full queue drops and counts them)."""
        batch = KVEventBatch(ts=self.clock(), events=events, data_parallel_rank=0)
        with self._lock:
            seq = next(self._seq)
            try:
                self._queue.put_nowait((topic, seq, batch))
                self._wake()
            except queue.Full:
                self.dropped_batches += 1
                self.dropped_events += len(events)
                if self.dropped_batches == 1 or not self.dropped_batches % 1000:
                    log.warning(
                        "kv events: the queue is full, %d batches (%d events) dropped so far",
                        self.dropped_batches,
                        self.dropped_events,
                    )

    def _wake(self) -> None:
        """Wake the sending thread (a byte on its pipe: a full pipe wakes it already; a closed
        one means it is gone)."""
        with contextlib.suppress(OSError):
            self._wake_send.send(b"\0")

    def _flush_all(self) -> None:
        self._flush_asked = False
        for stream in self.streams:
            stream.end_step()

    # ---- stopping

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Say every cache is cleared, send what is queued (for up to `timeout`), close."""
        for stream in self.streams:
            stream.cleared()
            stream.end_step()
        if self._running:
            self._running = False
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout)
            with self._lock:
                self._wake()
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets(linger_ms=int(timeout * 1000))
        if self.dropped_batches:
            log.warning(
                "kv events: %d batches (%d events) were dropped",
                self.dropped_batches,
                self.dropped_events,
            )

    def _close_sockets(self, linger_ms: int = 0) -> None:
        self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)
        with self._lock:
            self._wake_send.close()
            self._wake_recv.close()

    # ---- the sending thread

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        poller = zmq.Poller()
        poller.register(self._wake_recv, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        last_flush = time.monotonic()
        while True:
            sent = self._send_queued(encode)
            if sent is None:
                return
            now = time.monotonic()
            if sent:
                last_flush = now
            elif now - last_flush >= IDLE_FLUSH_S:
                self._ask_flush()
                last_flush = now
            ready = dict(poller.poll(0 if sent == BATCHES_PER_PASS else IDLE_POLL_MS))
            if self._wake_recv in ready:
                with contextlib.suppress(BlockingIOError):
                    self._wake_recv.recv(4096)
            if self._replay is not None and self._replay in ready:
                try:
                    self._answer_replays()
                except zmq.ZMQError as error:
                    log.warning("kv events: replay failed: %s", error)

    def _send_queued(self, encode: Callable[[Any], bytes]) -> int | None:
        """Send up to `BATCHES_PER_PASS` queued batches; how many, or None at the stop mark."""
        for sent in range(BATCHES_PER_PASS):
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return sent
            if item is None:
                return None
            topic, seq, batch = item
            payload = encode(batch)
            self._buffer.append((seq, topic, payload))
            self.published_batches += 1
            try:
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as error:
                log.warning("kv events: send failed: %s", error)
        return BATCHES_PER_PASS

    def _ask_flush(self) -> None:
        """Events recorded between steps wait for a step: when none comes, ask for a flush."""
        if self._request_flush is None or self._flush_asked:
            return
        if any(stream.pending for stream in self.streams):
            self._flush_asked = True
            self._request_flush(self._flush_all)

    def _answer_replays(self) -> None:
        """Answer the requests waiting, within a pass's bounds. A request is `(identity, b"",
        start seq as 8 bytes big-endian)`; the answer is every kept batch from there as
        `(identity, b"", topic, seq, payload)`, then `(identity, b"", b"", -1, b"")`, as vLLM's
        replay socket answers. Malformed requests, and a peer's requests after its first of the
        pass (a client waits for its end marker before asking again), are counted and dropped."""
        assert self._replay is not None
        answered: set[bytes] = set()
        for _ in range(REPLAY_READS_PER_PASS):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[0] in answered:
                self._ignore(frames)
                continue
            client, _, start_bytes = frames
            answered.add(client)
            self._answer(client, int.from_bytes(start_bytes, "big"))
            if len(answered) == REPLAY_ANSWERS_PER_PASS:
                return

    def _answer(self, client: bytes, start: int) -> None:
        assert self._replay is not None
        first = bisect_left(self._buffer, start, key=lambda kept: kept[0])
        for seq, topic, payload in itertools.islice(self._buffer, first, None):
            self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _ignore(self, frames: list[bytes]) -> None:
        """Count a request that gets no answer; logged at the first and every 1,000th, so a
        flood of them does not become a flood of log lines."""
        self.ignored_replay_requests += 1
        if self.ignored_replay_requests == 1 or not self.ignored_replay_requests % 1000:
            log.warning(
                "kv events: %d replay requests ignored so far (this one has %d frames; a request "
                "has 3, and a peer's repeats before its answer are dropped)",
                self.ignored_replay_requests,
                len(frames),
            )


def _open(sock: zmq.Socket, endpoint: str) -> str:
    """Bind or connect as `zmq_endpoint_binds` says; the endpoint as bound (a port 0 filled)."""
    if "[" in endpoint or endpoint.count(":") > 2:
        sock.setsockopt(zmq.IPV6, 1)
    bind = zmq_endpoint_binds(endpoint)
    if not bind:
        sock.connect(endpoint)
        return endpoint
    sock.bind(endpoint.replace("://localhost:", "://127.0.0.1:", 1))
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
