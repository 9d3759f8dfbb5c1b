"""`kvctl load`: realistic request traffic against an agent, from seeded workload profiles.

`profiles` says what is sent (prompts, lengths, arrival pattern) and is pure; `runner` sends it
with async httpx under a rate or a concurrency, bounded in count and time; `report` turns the
results into latency percentiles and throughput. Nothing here imports torch.
"""
