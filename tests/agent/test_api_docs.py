"""docs/api.md is the agent's own OpenAPI schema in prose: regenerated, it must not change."""

from pathlib import Path

from kvctl.agent.startup.api_docs import agent_openapi, api_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_reference_is_current() -> None:
    committed = (ROOT / "docs" / "api.md").read_text()
    assert committed == api_markdown(), (
        "docs/api.md is stale: run `python -m kvctl.agent.startup.api_docs > docs/api.md`"
    )


def test_every_route_and_every_snapshot_field_is_in_it() -> None:
    schema = agent_openapi()
    text = api_markdown(schema)
    for path, operations in schema["paths"].items():
        for method in operations:
            assert f"| {method.upper()} | `{path}` |" in text
    snapshot = schema["components"]["schemas"]["PoolSnapshot"]["properties"]
    assert "fragmentation_ratio" in snapshot and "alloc_attempts_total" in snapshot
    for field in snapshot:
        assert f"| `{field}` |" in text
