#!/usr/bin/env bash
# The checks that need a GPU, as one script: the pool, model, runtime and prefix tests with their
# tensors on CUDA, the decode-step and defrag benchmarks on CUDA, and a real agent on CUDA sized
# from free GPU memory, under load, read back through the CLI and /metrics.
#
#     bash benchmarks/cuda_checks.sh          # PYTHON=... to pick the interpreter
set -u
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
step() { printf '\n==== %s\n' "$*"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"

# One process per directory: a device-side assert poisons the CUDA context for the rest of a
# process, so one bad test would otherwise fail every test after it.
for dir in tests/pool tests/model tests/runtime tests/prefix; do
    step "tests on cuda: $dir"
    KVCTL_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider "$dir"
done

step "sleep and wake on cuda (level 1 moves the weights to host memory and back)"
KVCTL_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider tests/agent/test_model_sleep.py \
    tests/agent/test_model_sleep_properties.py

step "decode step benchmarks (paged vs contiguous, paired rounds; each prints its roofline: the
bytes a step reads, weights + the batch's KV, over the measured device copy bandwidth)"
$PY benchmarks/decode_step.py --device cuda
$PY benchmarks/decode_step.py --device cuda --model llama-1b --batch 8 --context 512
$PY benchmarks/decode_step.py --device cuda --model llama-1b --batch 32 --context 512
$PY benchmarks/decode_step.py --device cuda --model llama-1b --batch 32 --context 2048
$PY benchmarks/decode_step.py --device cuda --model llama-1b --batch 64 --context 512
$PY benchmarks/decode_step.py --device cuda --model llama-1b --batch 8 --context 512 --read-path gather
$PY benchmarks/decode_step.py --device cuda --model llama-1b --batch 32 --context 512 --read-path gather

step "defrag bandwidth"
$PY benchmarks/defrag_bandwidth.py --device cuda
$PY benchmarks/defrag_bandwidth.py --device cuda --layers 16 --kv-heads 8 --head-dim 64 \
    --dtype bfloat16 --pages 16384 --segment-pages 2048

step "host-side pool work on this machine's CPU (allocation traces, defrag ticks)"
$PY benchmarks/pool_alloc_free.py
$PY benchmarks/defrag_tick.py

step "agent on cuda"
PORT=18477
export KVCTL_AGENT=http://127.0.0.1:$PORT
$PY -m kvctl.agent.startup.main --device cuda --gpu-memory-fraction 0.01 --port $PORT \
    --alert-interval 1s >"${OUT:-/tmp}/agent.log" 2>&1 &
AGENT=$!
for _ in $(seq 90); do curl -sf "$KVCTL_AGENT/healthz" >/dev/null && break; sleep 1; done
$PY -m kvctl.cli.main load --profile chat --concurrency 16 --duration 20
$PY -m kvctl.cli.main defrag --now
$PY -m kvctl.cli.main status
curl -s "$KVCTL_AGENT/metrics" | grep -E '^kvctl_(pool_|alloc|prefix|defrag_runs|gpu)'
kill "$AGENT"; wait "$AGENT"
echo "agent exit $?"
