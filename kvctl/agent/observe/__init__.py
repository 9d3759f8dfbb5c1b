"""What the agent tells the world about itself: the Prometheus metrics (`metrics`, and the
generated docs/metrics.md, `metrics_docs`), the KV-event stream (`kv_events`), the alert loop
(`alerting`), GPU readings (`gpu`) and the small counters the façade keeps (`tally`, `window`).
It reads the engine's snapshots and never steers the engine, the HTTP side or start-up."""
