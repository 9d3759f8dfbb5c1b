"""`python -m kvctl.agent.startup.settings_docs > docs/settings.md`: the runtime settings
(kvctl.settings), then the start-up settings (the fields of kvctl.agent.config.AgentConfig)."""

import sys

from kvctl.agent.startup.settings import render_settings_docs

sys.stdout.write(render_settings_docs())
