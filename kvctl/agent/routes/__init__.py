"""The agent's HTTP routes, one module per resource: `ops` (pool, defrag, resize, alerts,
settings, metrics), `completions` (the OpenAI-compatible API) and `runbook`."""
