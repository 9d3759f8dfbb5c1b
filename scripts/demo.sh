#!/usr/bin/env bash
# `make demo`: runs scripts/demo.py (the story, then `kvctl top`) with the project's virtualenv.
# KVCTL_DEMO_PORT (default 8477), KVCTL_DEMO_SECONDS (default 45: how long the status table runs
# without a terminal) and KVCTL_DEMO_ALERTMANAGER=off are read there.
set -euo pipefail

cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/demo.py "$@"
