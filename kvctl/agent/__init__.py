"""The per-node agent: paged KV pool, model runtime, HTTP server, metrics and alerts."""
