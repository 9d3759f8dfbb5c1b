"""Shared pytest setup: a hypothesis profile sized for a 2-core CI machine.

Set HYPOTHESIS_PROFILE to pick another registered profile (hypothesis has `default`).
"""

import os

from hypothesis import settings

# No deadline: timing on shared CI machines is noisy, and pytest-timeout bounds each test anyway.
settings.register_profile("ci", deadline=None, max_examples=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
