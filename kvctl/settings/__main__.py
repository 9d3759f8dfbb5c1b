"""`python -m kvctl.settings > docs/settings.md`."""

import sys

from kvctl.settings import render_markdown

sys.stdout.write(render_markdown())
