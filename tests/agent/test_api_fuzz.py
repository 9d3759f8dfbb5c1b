"""Fuzz a real agent from its own OpenAPI description: no input may cause a 5xx.

Schemathesis generates bodies and parameters for every operation, valid and not; hypothesis
drives them. (Its pytest plugin is not used: the agent's URL is only known once the process
runs, so the operations are walked inside one test.)
"""

import pytest
import schemathesis
from agent_process import launch_agent
from hypothesis import HealthCheck, given, settings

pytestmark = pytest.mark.integration
EXAMPLES_PER_OPERATION = 12


@pytest.fixture(scope="module")
def fuzzed_agent():
    """Its own agent: fuzzed resizes and settings must not disturb other tests."""
    agent = launch_agent("--pool-pages", "64", "--segment-pages", "16", "--max-pool-pages", "256")
    yield agent
    agent.stop()


@pytest.mark.slow
def test_no_input_causes_a_server_error(fuzzed_agent) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzzed_agent.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 11
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def call(case) -> None:
            body = case.body
            if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
                body["max_tokens"] = min(body["max_tokens"], 4)  # keep each example cheap
            response = case.call(base_url=fuzzed_agent.url, timeout=60)
            assert response.status_code < 500, (case.method, case.path, body, response.text)

        call()
