"""The agent's HTTP side: the FastAPI app and its server (`server`), what every handler reads
(`context`), the connection limits (`connections`), the audit log of mutations (`audit`), one
router per resource (`routes/`) and the generated API reference (`api_docs`). It reaches the
models through the engine façade (`kvctl.agent.service`, `model_pool`, `prefix_admin`) and the
wire models of `kvctl.api`."""
