"""`python -m kvctl.settings > docs/settings.md`: the runtime settings (defined here), then the
start-up settings (the fields of kvctl.agent.config.AgentConfig)."""

import sys

from kvctl.agent.startup_settings import render_settings_docs

sys.stdout.write(render_settings_docs())
