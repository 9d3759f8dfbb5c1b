"""KV events in vLLM's wire format: the encoding read with vLLM's struct layout (copied here,
not imported), pages published in chain order with their tokens, tiers under the same names,
salted pages kept private, sequence numbers with a visible gap for a dropped batch, the replay
socket's protocol, the start-up flags' rules, and a real agent's stream."""

from __future__ import annotations

import re
import time
from itertools import pairwise
from typing import Any

import httpx
import msgspec
import pytest
import torch
import zmq

from kvctl.agent.config import ConfigError, load_config
from kvctl.agent.model.sampling import SamplingParams
from kvctl.agent.observe import kv_events as kv
from kvctl.agent.pool.storage import KVStorage
from kvctl.agent.prefix import IsolationKey
from kvctl.agent.runtime.request import RequestStatus
from kvctl.agent.tiers.page_keys import page_digests, root_digest

PAGE = 4  # make_engine's page size
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)
F32 = torch.float32


# ---- vLLM 0.32's layout (vllm/distributed/kv_events.py), field lists copied ----------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
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
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(type=KVEventBatch).decode


def test_a_batch_is_read_with_vllms_layout() -> None:
    batch = kv.KVEventBatch(
        ts=12.5,
        events=[
            kv.BlockStored(
                block_hashes=[7, 2**64 - 1],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            ),
            kv.BlockRemoved(block_hashes=[7], medium="CPU", group_idx=0),
            kv.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    payload = msgspec.msgpack.encode(batch)
    read = DECODE(payload)
    assert read.ts == 12.5 and read.data_parallel_rank == 0
    stored, removed, cleared = read.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    assert stored.block_hashes == [7, 2**64 - 1] and stored.parent_block_hash is None
    assert (stored.token_ids, stored.block_size, stored.medium) == (
        [1, 2, 3, 4, 5, 6, 7, 8],
        4,
        "GPU",
    )
    assert (removed.block_hashes, removed.medium) == ([7], "CPU")
    # the layout itself: the batch an array, each event a map tagged by its class's name
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and raw[0] == 12.5 and raw[2] == 0
    assert [e["type"] for e in raw[1]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert "extra_keys" not in raw[1][0] and raw[1][0]["group_idx"] == 0  # defaults omitted


# ---- one engine's stream -----------------------------------------------------------------


def recorded(engine: Any) -> tuple[kv.KVEventPublisher, list[list[Any]]]:
    """A publisher whose batches are kept in a list (its sockets stay unused)."""
    publisher = kv.KVEventPublisher("tcp://127.0.0.1:0")
    batches: list[list[Any]] = []
    publisher.submit = lambda topic, events: batches.append(events)  # type: ignore[method-assign]
    publisher.attach(engine, "kv@test@demo")
    return publisher, batches


def of(batches: list[list[Any]], kind: type, medium: str | None = None) -> list[Any]:
    return [
        e
        for events in batches
        for e in events
        if isinstance(e, kind) and (medium is None or e.medium == medium)
    ]


def test_stored_pages_are_whole_pages_in_chain_order(make_engine) -> None:
    engine = make_engine()
    publisher, batches = recorded(engine)
    assert [type(e) for e in batches.pop(0)] == [kv.AllBlocksCleared]  # the start
    shared = list(range(10, 20))  # 2 whole pages and half of the third
    a, b = [*shared, *range(30, 40)], [*shared, *range(60, 70)]  # 5 whole pages each
    engine.generate([a], ONE_TOKEN)
    engine.generate([b], ONE_TOKEN)
    first, second = of(batches, kv.BlockStored)
    assert len(batches) == 2  # one batch per step that changed the cache
    assert (first.parent_block_hash, first.token_ids, first.block_size) == (None, a, PAGE)
    assert len(first.block_hashes) == 5 and len(set(first.block_hashes)) == 5
    # b's pages past what a holds: from the page it diverges in, under a's page before it
    assert second.parent_block_hash == first.block_hashes[1]
    assert second.token_ids == b[2 * PAGE :] and len(second.block_hashes) == 3
    assert not set(second.block_hashes) & set(first.block_hashes)
    assert {e.medium for e in (first, second)} == {"GPU"}
    # the names are the tiers' page digests of the model's partition
    layout = publisher.streams[0].layout
    root = root_digest(IsolationKey("demo"), layout)
    assert first.block_hashes == [kv.wire_hash(d) for d in page_digests(root, a, PAGE, 5)]


def test_salted_pages_are_never_published(make_engine) -> None:
    engine = make_engine()
    _, batches = recorded(engine)
    request = engine.add_request(list(range(10, 30)), ONE_TOKEN, cache_salt="tenant-a")
    while request.status is not RequestStatus.FINISHED:
        engine.step()
    assert engine.prefix_cache.stats().held_pages == 5  # cached, in the tenant's partition
    assert of(batches, kv.BlockStored) == []
    engine.prefix_cache.clear()
    engine.step()
    assert of(batches, kv.BlockRemoved) == []


def test_evicted_pages_go_to_the_host_tier_under_the_same_names(demo, make_engine) -> None:
    mc = demo[0]
    page_bytes = KVStorage.page_bytes(PAGE, mc.num_layers, mc.num_kv_heads, mc.head_dim, F32)
    engine = make_engine(pool_pages=16, segment_pages=16, host_tier_bytes=8 * page_bytes)
    _, batches = recorded(engine)
    prompts = [[100 + 20 * i + k for k in range(20)] for i in range(5)]  # 5 pages each
    for prompt in prompts:
        engine.generate([prompt], ONE_TOKEN)
    tokens_of, parent_of = {}, {}  # every page the device published
    for event in of(batches, kv.BlockStored, "GPU"):
        parent = event.parent_block_hash
        for k, page_hash in enumerate(event.block_hashes):
            tokens_of[page_hash] = event.token_ids[k * PAGE : (k + 1) * PAGE]
            parent_of[page_hash], parent = parent, page_hash
    to_host = of(batches, kv.BlockStored, "CPU")
    assert to_host, "the pool of 16 pages held 15: the fourth prompt evicted"
    for event in to_host:  # as self-describing as the device's: chain, parent and tokens
        hashes = event.block_hashes
        assert event.parent_block_hash == parent_of[hashes[0]]
        assert all(parent_of[h] == before for before, h in pairwise(hashes))
        assert event.token_ids == [t for h in hashes for t in tokens_of[h]]
    first = to_host[0]
    # the device lets a page go only after the tier holds it: stored CPU, then removed GPU
    batch = next(events for events in batches if first in events)
    removed = next(e for e in batch if isinstance(e, kv.BlockRemoved) and e.medium == "GPU")
    assert batch.index(first) < batch.index(removed) and removed.block_hashes == first.block_hashes
    # what the host tier holds is what was published as stored there and not removed since
    held = {kv.wire_hash(d) for d in engine.tiers.tier("host").index.entries}
    gone = {h for e in of(batches, kv.BlockRemoved, "CPU") for h in e.block_hashes}
    stored = {h for e in to_host for h in e.block_hashes}
    assert held == stored - gone and gone


def test_pages_no_medium_holds_are_forgotten_at_the_end_of_the_step(make_engine) -> None:
    engine = make_engine()
    publisher, _ = recorded(engine)
    stream = publisher.streams[0]
    engine.generate([list(range(10, 30))], ONE_TOKEN)
    assert len(stream._pages) == 5
    engine.prefix_cache.clear()
    assert len(stream._pages) == 5  # until the step's batch is out
    stream.end_step()
    assert stream._pages == {}


# ---- the publisher: sequence numbers, drops, replay ---------------------------------------


def subscriber(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    time.sleep(0.5)  # the subscription reaches the PUB socket
    return sub


def received(sub: zmq.Socket, count: int, timeout_ms: int = 5000) -> list[tuple[bytes, int, bytes]]:
    out = []
    while len(out) < count and sub.poll(timeout_ms):
        topic, seq, payload = sub.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), payload))
    return out


def replay(endpoint: str, start: int, timeout_ms: int = 5000) -> list[list[bytes]]:
    """Every answer to one replay request, the end marker included; each within `timeout_ms`."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    answers = []
    while dealer.poll(timeout_ms):
        frames = dealer.recv_multipart()
        answers.append(frames)
        if frames[2] == kv.END_SEQ:
            break
    dealer.close()
    return answers


def one_event(n: int) -> list[Any]:
    return [kv.BlockRemoved(block_hashes=[n], medium="GPU", group_idx=0)]


def test_a_full_queue_drops_and_counts_and_leaves_a_gap_in_the_sequence() -> None:
    publisher = kv.KVEventPublisher("tcp://127.0.0.1:0", max_queue_size=2)
    try:
        sub = subscriber(publisher.endpoint)
        for n in range(4):  # the sending thread has not started: the queue fills
            publisher.submit(b"t", one_event(n) * (n + 1))
        assert (publisher.dropped_batches, publisher.dropped_events) == (2, 3 + 4)
        publisher.start()
        publisher.submit(b"t", one_event(9))
        got = received(sub, 3)
        assert [seq for _, seq, _ in got] == [0, 1, 4]  # 2 and 3 were dropped
        assert [DECODE(p).events[0].block_hashes[0] for _, _, p in got] == [0, 1, 9]
        assert publisher.published_batches == 3
    finally:
        publisher.close()
        sub.close()


def test_replay_answers_from_a_sequence_number_as_vllm_does() -> None:
    publisher = kv.KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=3)
    try:
        sub = subscriber(publisher.endpoint)
        publisher.start()
        for n in range(4):
            publisher.submit(b"kv@p@m", one_event(n))
        live = received(sub, 4)
        assert [seq for _, seq, _ in live] == [0, 1, 2, 3]
        answers = replay(publisher.replay_endpoint, 0)
        *batches, end = answers
        assert end == [b"", b"", kv.END_SEQ, b""]
        # the buffer keeps the last 3 steps; each answer is (b"", topic, seq, payload)
        assert [(f[0], f[1], int.from_bytes(f[2], "big")) for f in batches] == [
            (b"", b"kv@p@m", 1),
            (b"", b"kv@p@m", 2),
            (b"", b"kv@p@m", 3),
        ]
        assert [f[3] for f in batches] == [payload for _, _, payload in live[1:]]
        later = replay(publisher.replay_endpoint, 3)
        assert [int.from_bytes(f[2], "big") for f in later] == [3, -1 % 2**64]
    finally:
        publisher.close()
        sub.close()


def dealers(endpoint: str, count: int) -> list[zmq.Socket]:
    sockets = []
    for _ in range(count):
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        sockets.append(dealer)
    return sockets


def test_a_burst_of_garbage_replay_requests_does_not_starve_a_valid_one() -> None:
    """2,000 malformed requests from 200 connections: the ROUTER takes one message per peer in
    turn, so a sending thread that read one request per 50 ms answered a newcomer after ~10 s."""
    publisher = kv.KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    flooders = dealers(publisher.replay_endpoint, 200)
    try:
        publisher.start()
        publisher.submit(b"t", one_event(7))
        for dealer in flooders:
            for _ in range(10):
                dealer.send(b"garbage")  # two frames at the ROUTER: not a request
        time.sleep(0.3)  # the burst reaches the ROUTER first
        started = time.monotonic()
        answers = replay(publisher.replay_endpoint, 0, timeout_ms=2000)
        assert [a[2] for a in answers] == [(0).to_bytes(8, "big"), kv.END_SEQ]
        assert time.monotonic() - started < 2
        assert not any(dealer.poll(0) for dealer in flooders)  # garbage gets no answer
    finally:
        publisher.close()
        for dealer in flooders:
            dealer.close()


def end_markers(dealer: zmq.Socket, timeout_ms: int = 500) -> int:
    """Answers to the replay requests `dealer` sent, counted by their end markers."""
    ends = 0
    while dealer.poll(timeout_ms):
        ends += dealer.recv_multipart()[2] == kv.END_SEQ
    return ends


def test_a_peer_gets_one_answer_per_pass_however_many_times_it_asks() -> None:
    """Each answer may be the whole buffer: a peer repeating its request in one burst gets one
    answer a pass, and a peer asking once beside it is answered too."""
    publisher = kv.KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    greedy, polite = dealers(publisher.replay_endpoint, 2)
    try:
        publisher.submit(b"t", one_event(7))
        for _ in range(50):
            greedy.send_multipart([b"", (0).to_bytes(8, "big")])
        polite.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(1)  # the requests reach the ROUTER before the thread reads any
        publisher.start()
        assert end_markers(polite) == 1
        assert 1 <= end_markers(greedy) <= 3  # one, unless the burst straggled in
        assert publisher.ignored_replay_requests >= 47
    finally:
        publisher.close()
        greedy.close()
        polite.close()


def test_events_between_steps_go_out_without_a_step(make_engine) -> None:
    engine = make_engine()
    publisher = kv.KVEventPublisher("tcp://127.0.0.1:0")
    publisher.attach(engine, "t")
    engine.generate([list(range(10, 30))], ONE_TOKEN)
    calls = []

    def call_on_engine(fn):  # the engine thread, between steps (here: the sending thread)
        calls.append(fn)
        fn()

    try:
        sub = subscriber(publisher.endpoint)
        publisher.start(call_on_engine)
        assert len(received(sub, 2)) == 2  # the start's AllBlocksCleared and the first batch
        engine.prefix_cache.clear()  # an admin command: no step follows
        (got,) = received(sub, 1)
        removed = DECODE(got[2]).events
        assert [type(e) for e in removed] == [BlockRemoved] and len(removed[0].block_hashes) == 5
        assert len(calls) == 1
    finally:
        publisher.close()
        sub.close()


def test_a_bind_that_fails_is_one_line() -> None:
    first = kv.KVEventPublisher("tcp://127.0.0.1:0")
    try:
        with pytest.raises(ValueError, match="kv events: Address already in use"):
            kv.KVEventPublisher(first.endpoint)
    finally:
        first.close()


# ---- start-up flags -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"kv_events_endpoint": "tcp://*:5557"}, "refusing to publish KV events on tcp://*:5557"),
        (
            {
                "kv_events_endpoint": "tcp://127.0.0.1:5557",
                "kv_events_replay_endpoint": "tcp://0.0.0.0:5558",
            },
            "refusing to publish KV events on tcp://0.0.0.0:5558 without a token",
        ),
        ({"kv_events_replay_endpoint": "tcp://127.0.0.1:5558"}, "needs --kv-events-endpoint"),
        ({"kv_events_endpoint": "udp://x:1"}, "write tcp://HOST:PORT"),
        ({"kv_events_endpoint": "tcp://127.0.0.1:99999"}, "the port must be 0 to 65535"),
        ({"kv_events_endpoint": "tcp://epp:0"}, "port 0 only binds"),
        (
            {"kv_events_endpoint": "tcp://127.0.0.1:1", "kv_events_replay_endpoint": "tcp://epp:2"},
            "the replay socket binds",
        ),
        (
            {
                "kv_events_endpoint": "tcp://127.0.0.1:1",
                "kv_events_replay_endpoint": "tcp://127.0.0.1:1",
            },
            "must differ",
        ),
        (
            {"kv_events_endpoint": "tcp://127.0.0.1:1", "prefix_cache": False},
            "needs the prefix cache",
        ),
        (
            {"kv_events_endpoint": "tcp://127.0.0.1:1", "kv_events_topic": "kv@{pod}"},
            "only {model}",
        ),
        (
            {
                "kv_events_endpoint": "tcp://127.0.0.1:1",
                "model": ["a=demo", "b=demo"],
                "kv_events_topic": "kv",
            },
            "needs {model}",
        ),
    ],
)
def test_event_flags_that_are_refused(flags, message, monkeypatch) -> None:
    monkeypatch.delenv("KVCTL_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(flags)


def test_event_endpoints_on_every_address_need_a_token(monkeypatch) -> None:
    monkeypatch.setenv("KVCTL_TOKEN", "s3cret")
    config = load_config(
        {"kv_events_endpoint": "tcp://*:5557", "kv_events_replay_endpoint": "tcp://*:5558"}
    )
    assert config.kv_events_public() == ["tcp://*:5557", "tcp://*:5558"]
    monkeypatch.delenv("KVCTL_TOKEN")
    for local in (
        "tcp://127.0.0.1:5557",
        "tcp://[::1]:5557",
        "tcp://localhost:5557",
        "ipc:///tmp/kv",
    ):
        assert load_config({"kv_events_endpoint": local}).kv_events_public() == []
    remote = load_config({"kv_events_endpoint": "tcp://epp.inference:5557"})  # connects
    assert remote.kv_events_public() == [] and remote.kv_events_topic == "kv@{hostname}@{model}"


# ---- a real agent -------------------------------------------------------------------------


@pytest.mark.integration
def test_a_real_agent_publishes_its_prompts_pages_and_replays_them(start_agent) -> None:
    agent = start_agent(
        *("--pool-pages", "256", "--segment-pages", "32", "--page-size", "16"),
        *("--kv-events-endpoint", "tcp://127.0.0.1:0"),
        *("--kv-events-replay-endpoint", "tcp://127.0.0.1:0"),
        *("--kv-events-topic", "kv@pod-1@{model}"),
    )
    (line,) = [line for line in agent.log if "kv events: publishing on" in line]
    endpoint, replay_endpoint = re.findall(r"tcp://127\.0\.0\.1:\d+", line)
    assert "topics kv@pod-1@demo" in line
    sub = subscriber(endpoint)
    shared = [(7 * i) % 250 + 3 for i in range(40)]  # 2 whole pages and half of the third
    a = [*shared, *range(100, 130)]  # 70 tokens: 4 whole pages
    b = [*shared, *range(200, 230)]
    try:
        with httpx.Client(base_url=agent.url, timeout=60) as http:
            for prompt in (a, b):
                body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
                reply = http.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
        live = received(sub, 2, timeout_ms=10000)
        assert {topic for topic, _, _ in live} == {b"kv@pod-1@demo"}
        stored = [e for _, _, p in live for e in DECODE(p).events if isinstance(e, BlockStored)]
        first, second = stored
        assert (first.parent_block_hash, first.token_ids) == (None, a[:64])
        assert len(first.block_hashes) == 4 and first.block_size == 16 and first.medium == "GPU"
        assert second.parent_block_hash == first.block_hashes[1]  # the chain both prompts share
        assert second.token_ids == b[32:64] and len(second.block_hashes) == 2
        answers = replay(replay_endpoint, 0)
        *batches, end = answers
        assert end[2] == kv.END_SEQ
        assert [type(e) for e in DECODE(batches[0][3]).events] == [AllBlocksCleared]
        assert int.from_bytes(batches[0][2], "big") == 0
        replayed = {int.from_bytes(f[2], "big"): f[3] for f in batches}
        assert all(replayed[seq] == payload for _, seq, payload in live)
        assert agent.stop() == 0
        (last,) = received(sub, 1)  # a stopped agent caches nothing
        assert [type(e) for e in DECODE(last[2]).events] == [AllBlocksCleared]
    finally:
        sub.close()
