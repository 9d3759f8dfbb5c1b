"""The agent's HTTP routes, one module-level `router` per resource: `health`, `pools` (snapshots,
maps, defrag, resize, release), `prefix` (lookups, pins, clears), `sleep` (sleep and wake a
model), `alerts`, `settings` (`/v1/config`), `models`, `metrics`,
`completions` and `chat` (the OpenAI-compatible API, sharing `generation`), `tokenize` and
`runbook`. Handlers read the `ServerContext` through a dependency (`kvctl.agent.http.context`)."""
