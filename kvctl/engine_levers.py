"""The levers other inference engines expose over HTTP, and pulling them from kvctl.

One table says which lever each engine has (clear its prefix cache, sleep, wake, say whether it
sleeps), how it is called, and the flag or environment variable the server must be started with
for it to exist; `pull` calls one on a server with the `--token` and `--timeout` every kvctl
command uses, each answer read within the timeout and a size cap (`kvctl.bounded_read`).

Every failure is a `LeverError` (an `AgentError`, so the CLI prints and exits as for an agent)
whose text is one line naming the server and what to do: a lever the engine lacks, one its
server was started without (a 404 or 405, or a configuration read that says it is off), a
refusal, or an answer that is not the engine's. An answer kvctl cannot read claims nothing: the
line says what is known and what is not.

Checked against vLLM 0.32.0 (vllm/entrypoints/serve/dev/: routes registered only with
VLLM_SERVER_DEV_MODE=1), SGLang's python/sglang/srt/entrypoints/http_server.py (commit
0025436e) and TensorRT-LLM's tensorrt_llm/serve/openai_server.py (commit 00057725), which
clears no cache and has only the RL-only /release_memory and /resume_memory, answered only by
its AsyncLLM.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kvctl import bounded_read
from kvctl.bounded_read import MAX_JSON_BYTES, ReadLimit, check_depth
from kvctl.client import (
    DEFAULT_TIMEOUT,
    AgentError,
    AgentUnauthorized,
    AgentUnreachable,
    normalize_url,
    request_headers,
    tls_context,
)
from kvctl.engines import KVCTL, SGLANG, TRTLLM, VLLM, Engine, engine_named, split_engine

PREFIX_CLEAR = "prefix clear"
SLEEP = "sleep"
WAKE = "wake"
SLEEP_STATE = "sleep state"
LEVER_NAMES = (PREFIX_CLEAR, SLEEP, WAKE, SLEEP_STATE)


# ---- errors ---------------------------------------------------------------------------------


class LeverError(AgentError):
    """The server did not (or may not have) done what was asked; one line saying what to do."""


class LeverMissing(LeverError):
    """The engine has no such lever at all: nothing was sent."""


class LeverOff(LeverError):
    """The server was started without what enables the lever; nothing changed."""


class LeverRefused(LeverError):
    """The server understood and declined (requests still running); nothing changed."""


class LeverAnswerError(LeverError):
    """An answer that is not the engine's (a 5xx, garbage): nothing is claimed."""


# ---- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gate:
    """A configuration read that says whether a lever would do what it says, made first: a
    vLLM started without --enable-sleep-mode still answers /sleep (pausing and aborting its
    requests) while it frees no memory, so kvctl asks before it sends."""

    path: str
    key: tuple[str, ...]
    """Where the switch is in the JSON answer."""
    flag: str
    why: str
    """What pulling the lever without it would do, for the refusal."""


@dataclass(frozen=True)
class Lever:
    """One lever of one engine."""

    method: str
    path: str
    enabled_by: str | None
    """The flag or environment variable without which the route is absent (a 404)."""
    read: Callable[[httpx.Response], LeverAnswer]
    """Turns a 2xx answer into what it says, or raises ValueError saying what was off."""
    body: Any = None
    gate: Gate | None = None
    refusal: str = ""
    """What a 400 from the server means, for the one line."""


@dataclass(frozen=True)
class LeverAnswer:
    """What a 2xx answer says: done, refused with a reason, and the sleeping state if known."""

    done: bool
    sleeping: bool | None = None
    reason: str = ""


@dataclass(frozen=True)
class LeverResult:
    """What a lever did on one server, as `kvctl sleep`/`wake`/`prefix clear` show it."""

    agent: str
    engine: str
    lever: str
    done: bool
    sleeping: bool | None
    """Whether the server sleeps now, where its answer says (None: not known)."""
    level: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "engine": self.engine,
            "lever": self.lever,
            "done": self.done,
            "sleeping": self.sleeping,
            "level": self.level,
        }


def _json(response: httpx.Response) -> Any:
    check_depth(response.content)
    try:
        return json.loads(response.content)
    except ValueError:
        raise ValueError("not JSON") from None


def _field(data: Any, key: str, kind: type) -> Any:
    if not isinstance(data, dict) or not isinstance(data.get(key), kind):
        raise ValueError(f"no {kind.__name__} {key!r}")
    return data[key]


def _vllm_reset(response: httpx.Response) -> LeverAnswer:
    # vllm/entrypoints/serve/dev/cache/api_router.py: {"success": bool}; false while blocks are
    # still held (running requests, in-flight KV offload transfers)
    if _field(_json(response), "success", bool):
        return LeverAnswer(done=True)
    return LeverAnswer(
        done=False,
        reason="blocks are still held by running requests (or KV offload transfers); "
        "retry when it is idle",
    )


def _vllm_sleep(response: httpx.Response) -> LeverAnswer:
    # dev/sleep/api_router.py: {"status": "sleeping", "level": N}
    if _field(_json(response), "status", str) != "sleeping":
        raise ValueError('"status" is not "sleeping"')
    return LeverAnswer(done=True, sleeping=True)


def _vllm_wake(response: httpx.Response) -> LeverAnswer:
    # {"status": "awake" | "sleeping", "tags": ...}: "sleeping" when part of its memory is
    # still released (a partial wake by tags)
    status = _field(_json(response), "status", str)
    if status not in ("awake", "sleeping"):
        raise ValueError(f'"status" is {status!r}, not "awake" or "sleeping"')
    return LeverAnswer(done=True, sleeping=status == "sleeping")


def _vllm_is_sleeping(response: httpx.Response) -> LeverAnswer:
    return LeverAnswer(done=True, sleeping=_field(_json(response), "is_sleeping", bool))


def _sglang_flush(response: httpx.Response) -> LeverAnswer:
    # http_server.py flush_cache: text/plain "Cache flushed.\n..." with 200 (400 when not done)
    if not response.text.startswith("Cache flushed."):
        raise ValueError('not "Cache flushed."')
    return LeverAnswer(done=True)


def _sglang_memory(sleeping: bool) -> Callable[[httpx.Response], LeverAnswer]:
    # release_memory_occupation / resume_memory_occupation return None: a JSON `null`
    def read(response: httpx.Response) -> LeverAnswer:
        if _json(response) is not None:
            raise ValueError("not the null SGLang answers")
        return LeverAnswer(done=True, sleeping=sleeping)

    return read


VLLM_DEV_MODE = "VLLM_SERVER_DEV_MODE=1"
LEVERS: dict[str, dict[str, Lever]] = {
    VLLM.name: {
        PREFIX_CLEAR: Lever("POST", "/reset_prefix_cache", VLLM_DEV_MODE, _vllm_reset),
        SLEEP: Lever(
            "POST",
            "/sleep",
            VLLM_DEV_MODE,
            _vllm_sleep,
            gate=Gate(
                "/server_info?config_format=json",
                ("vllm_config", "model_config", "enable_sleep_mode"),
                "--enable-sleep-mode",
                "without it vLLM pauses and aborts its requests yet frees no memory",
            ),
        ),
        WAKE: Lever("POST", "/wake_up", VLLM_DEV_MODE, _vllm_wake),
        SLEEP_STATE: Lever("GET", "/is_sleeping", VLLM_DEV_MODE, _vllm_is_sleeping),
    },
    SGLANG.name: {
        PREFIX_CLEAR: Lever(
            "POST",
            "/flush_cache",
            None,
            _sglang_flush,
            refusal="SGLang flushes only while no request runs or waits; retry when it is idle",
        ),
        SLEEP: Lever(
            "POST",
            "/release_memory_occupation",
            None,
            _sglang_memory(sleeping=True),
            body={},
            gate=Gate(
                "/get_server_info",
                ("enable_memory_saver",),
                "--enable-memory-saver",
                "without it SGLang flushes its cache yet frees no memory",
            ),
            refusal="SGLang releases its memory only while it is idle",
        ),
        WAKE: Lever(
            "POST", "/resume_memory_occupation", None, _sglang_memory(sleeping=False), body={}
        ),
    },
    TRTLLM.name: {},
}
"""Each engine's levers by name; an engine without one has none."""

MISSING: dict[tuple[str, str], str] = {
    (SGLANG.name, SLEEP_STATE): "SGLang has no route that says whether its memory is released",
    (TRTLLM.name, PREFIX_CLEAR): "trtllm-serve has no route that clears its KV cache",
    (TRTLLM.name, SLEEP): (
        "trtllm-serve has no sleep kvctl pulls (its RL-only /release_memory answers only "
        "with an AsyncLLM generator)"
    ),
    (TRTLLM.name, WAKE): (
        "trtllm-serve has no wake kvctl pulls (its RL-only /resume_memory answers only with "
        "an AsyncLLM generator)"
    ),
    (TRTLLM.name, SLEEP_STATE): "trtllm-serve has no route that says whether it sleeps",
}
"""Why an engine lacks a lever, where there is more to say than that it does."""


def lever_of(engine: Engine, name: str) -> Lever:
    """The lever `name` of `engine`, or LeverMissing saying it has none."""
    lever = LEVERS.get(engine.name, {}).get(name)
    if lever is None:
        why = MISSING.get((engine.name, name), f"{engine.title} has no {name} lever")
        raise LeverMissing(engine.name, f"{why}; nothing was sent")
    return lever


def engine_target(agent: str) -> tuple[Engine | None, str]:
    """(the engine, its URL) of an `--agent` value; None for a kvctl agent."""
    name, url = split_engine(agent)
    if name in (None, KVCTL):
        return None, url
    return engine_named(name), normalize_url(url)


# ---- pulling --------------------------------------------------------------------------------


class EngineServer:
    """One engine's server over HTTP; use as a context manager."""

    def __init__(
        self,
        engine: Engine,
        url: str,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.engine = engine
        self.url = normalize_url(url)
        self.token = token
        self.timeout = timeout
        self._http = httpx.Client(
            base_url=self.url,
            headers=request_headers(token),
            timeout=timeout,
            transport=transport,
            verify=tls_context(),
        )

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    @property
    def agent(self) -> str:
        """The `--agent` form of this server, as outcomes name it."""
        return f"{self.engine.name}+{self.url}"

    @property
    def who(self) -> str:
        return f"{self.engine.title} at {self.url}"

    def pull(self, name: str, level: int | None = None) -> LeverResult:
        """Pull the lever `name` (`level` for vLLM's sleep) and say what the server answered."""
        lever = lever_of(self.engine, name)
        if lever.gate is not None:
            self._check_gate(lever, lever.gate)
        path = lever.path if level is None else f"{lever.path}?level={level}"
        response = self._send(lever.method, path, lever.body, sent=lever.method != "GET")
        self._check_status(name, lever, response)
        try:
            answer = lever.read(response)
        except (ValueError, ReadLimit) as error:
            raise LeverAnswerError(
                self.url,
                f"{self.who} answered {lever.method} {lever.path} with {response.status_code} "
                f"but not as {self.engine.title} does ({error}: "
                f"{_first_line(response)}); {self._unknown(name)}",
            ) from None
        if not answer.done:
            raise LeverRefused(
                self.url, f"{self.who} declined {name}: {answer.reason}; nothing changed"
            )
        return LeverResult(
            agent=self.agent,
            engine=self.engine.name,
            lever=name,
            done=True,
            sleeping=answer.sleeping,
            level=level if name == SLEEP else None,
        )

    def _check_gate(self, lever: Lever, gate: Gate) -> None:
        response = self._send("GET", gate.path, None, sent=False)
        if response.status_code in (404, 405):
            where = gate.path.split("?")[0]
            raise self._off(lever, f"GET {where} answered {response.status_code}")
        self._check_status(SLEEP, lever, response, sent=False)
        value: Any = None
        try:
            value = _json(response)
            for key in gate.key:
                value = value.get(key) if isinstance(value, dict) else None
        except (ValueError, ReadLimit):
            value = None
        if not isinstance(value, bool):
            raise LeverAnswerError(
                self.url,
                f"{self.who}: its {gate.path.split('?')[0]} does not say whether "
                f"{gate.flag} is on, so kvctl cannot tell whether {SLEEP} would free memory; "
                "nothing was sent",
            )
        if not value:
            raise LeverOff(
                self.url,
                f"{self.who} was started without {gate.flag}: {gate.why}; restart it with "
                f"{gate.flag} to use kvctl sleep; nothing was sent",
            )

    def _send(self, method: str, path: str, body: Any, *, sent: bool) -> httpx.Response:
        request = self._http.build_request(method, path, json=body)
        try:
            return bounded_read.read(self._http, request, self.timeout, MAX_JSON_BYTES)
        except httpx.TimeoutException:
            raise self._no_answer(f"did not answer within {self.timeout:g} s", path, sent) from None
        except ReadLimit as error:
            raise self._no_answer(str(error), path, sent) from None
        except httpx.TransportError as error:
            reason = str(error).split("] ")[-1].strip().lower() or type(error).__name__
            raise AgentUnreachable(
                self.url,
                f"cannot reach {self.who} ({reason}); check --agent {self.engine.name}+URL",
                reason=reason,
            ) from None

    def _no_answer(self, what: str, path: str, sent: bool) -> AgentUnreachable:
        outcome = (
            "it may or may not have acted: check before pulling again"
            if sent
            else "nothing was sent"
        )
        return AgentUnreachable(
            self.url,
            f"{self.who} {what} to {path.split('?')[0]} (raise --timeout for a slow one); "
            f"{outcome}",
            reason=what,
        )

    def _check_status(
        self, name: str, lever: Lever, response: httpx.Response, *, sent: bool = True
    ) -> None:
        code = response.status_code
        if code < 400:
            return
        if code in (401, 403):
            fix = "check --token or KVCTL_TOKEN" if self.token else "pass --token or KVCTL_TOKEN"
            raise AgentUnauthorized(
                self.url, f"{self.who}: {code} unauthorized; {fix}", reason=f"{code} unauthorized"
            )
        if code in (404, 405):
            raise self._off(lever, f"{lever.method} {lever.path} answered {code}")
        if code < 500 and lever.refusal:
            raise LeverRefused(self.url, f"{self.who} declined {name}: {lever.refusal}")
        said = _first_line(response)
        raise LeverAnswerError(
            self.url,
            f"{self.who} answered {code} to {lever.method} {lever.path.split('?')[0]} ({said}); "
            f"see its log; {self._unknown(name) if sent else 'nothing was sent'}",
        )

    def _off(self, lever: Lever, what: str) -> LeverOff:
        if lever.enabled_by is None:
            fix = f"is it {self.engine.title} (check --agent)?"
        else:
            fix = f"the route exists only when the server runs with {lever.enabled_by}"
        return LeverOff(self.url, f"{self.who}: {what}: {fix}; nothing changed")

    def _unknown(self, name: str) -> str:
        if name == SLEEP_STATE:
            return "its state is not known"
        return f"whether it did {name} is not known"


def _first_line(response: httpx.Response) -> str:
    lines = response.text.strip().splitlines()
    return lines[0][:160] if lines else "an empty body"


def pull(
    agent: str,
    name: str,
    token: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    level: int | None = None,
) -> LeverResult:
    """Pull the lever `name` of the engine server `agent` (`vllm+http://HOST:PORT`)."""
    engine, url = engine_target(agent)
    if engine is None:
        raise LeverMissing(agent, f"{agent} is a kvctl agent, not an engine's server")
    with EngineServer(engine, url, token, timeout) as server:
        return server.pull(name, level)


def clear_prefix_cache(
    agent: str, token: str | None = None, timeout: float = DEFAULT_TIMEOUT
) -> LeverResult:
    """Clear the prefix cache of the engine server `agent` (`vllm+http://HOST:PORT`,
    `sglang+http://...`): what `kvctl prefix clear` does for an engine's target. Raises a
    LeverError (LeverMissing for an engine without one: nothing was sent)."""
    return pull(agent, PREFIX_CLEAR, token, timeout)
