"""Constants the CLI keeps to start fast agree with the modules they stand for."""

from __future__ import annotations

from kvctl import client
from kvctl.api import RuntimeSettings
from kvctl.cli import config, options


def test_defaults_match_the_client() -> None:
    assert options.DEFAULT_AGENT == client.DEFAULT_AGENT
    assert options.DEFAULT_TIMEOUT == client.DEFAULT_TIMEOUT


def test_config_sections_match_the_api() -> None:
    assert tuple(RuntimeSettings.model_fields) == config.SECTIONS
