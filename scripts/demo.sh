#!/usr/bin/env bash
# `make demo`: an agent on the demo model, chat traffic from `kvctl load`, and `kvctl top`.
#
# Starts `kvctl-agent` on 127.0.0.1:$KVCTL_DEMO_PORT (default 8477) with a small pool, waits
# until it answers, drives multi-turn chat traffic at it in the background, then opens the live
# dashboard; without a terminal it prints the status table every 5 s for $KVCTL_DEMO_SECONDS
# (default 60) and then the load report. Everything it started is stopped on exit, and its logs
# are removed unless something failed.
set -euo pipefail

cd "$(dirname "$0")/.."
BIN=.venv/bin
PORT="${KVCTL_DEMO_PORT:-8477}"
SECONDS_TO_RUN="${KVCTL_DEMO_SECONDS:-60}"
URL="http://127.0.0.1:${PORT}"
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/kvctl-demo.XXXXXX")"
AGENT_PID=""
LOAD_PID=""

stop() {
    local status=$?
    for pid in "$LOAD_PID" "$AGENT_PID"; do
        if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true
        fi
    done
    if [[ $status -eq 0 ]]; then
        rm -rf "$LOGS"  # a clean run leaves nothing behind
    else
        echo "kvctl demo: logs kept in ${LOGS}" >&2
    fi
}
trap stop EXIT
trap 'exit 130' INT TERM

echo "kvctl demo: starting kvctl-agent on ${URL} (log: ${LOGS}/agent.log)"
"$BIN/kvctl-agent" --port "$PORT" --model demo --pool-pages 384 --segment-pages 32 \
    --report-cached-tokens >"$LOGS/agent.log" 2>&1 &
AGENT_PID=$!

for _ in $(seq 1 240); do
    if ! kill -0 "$AGENT_PID" 2>/dev/null; then
        echo "kvctl demo: the agent exited; its log says:" >&2
        cat "$LOGS/agent.log" >&2
        echo "kvctl demo: if the port is taken, run: KVCTL_DEMO_PORT=8478 make demo" >&2
        exit 1
    fi
    if "$BIN/kvctl" --agent "$URL" --timeout 2 status --json >/dev/null 2>&1; then
        break
    fi
    sleep 0.5
done
"$BIN/kvctl" --agent "$URL" --timeout 2 status >/dev/null || {
    echo "kvctl demo: the agent did not answer within 2 minutes; see ${LOGS}/agent.log" >&2
    exit 1
}

if [[ -t 1 ]]; then
    LOAD_SECONDS=3600  # runs until the dashboard is closed
else
    LOAD_SECONDS="$SECONDS_TO_RUN"
fi
echo "kvctl demo: driving chat traffic (kvctl load --profile chat, log: ${LOGS}/load.log)"
"$BIN/kvctl" --agent "$URL" load --profile chat --concurrency 6 --max-tokens 32 \
    --duration "$LOAD_SECONDS" --seed 1 >"$LOGS/load.log" 2>&1 &
LOAD_PID=$!

if [[ -t 1 ]]; then
    "$BIN/kvctl" --agent "$URL" top --interval 1
else
    "$BIN/kvctl" --agent "$URL" top --headless --duration "$SECONDS_TO_RUN" --every 5
    wait "$LOAD_PID" || true
    LOAD_PID=""
    echo
    cat "$LOGS/load.log"
fi
