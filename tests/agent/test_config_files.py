"""Hostile config files: `kvctl-agent --config F` (and --token-file F) refuses each one with
one line on stderr and exit 2, before anything starts, and never blocks, floods memory or
prints a traceback: not UTF-8, nested too deeply, not a regular file, too big, too many models.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.agent.config import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_MODELS,
    ConfigError,
    load_config,
)

HUGE_ARRAY = "a = " + "[" * 10**6 + "]" * 10**6 + "\n"
"""2 MB: refused for its size before its depth."""
DEEP_ARRAY = "a = " + "[" * 400_000 + "]" * 400_000 + "\n"
DEEP_TABLE = "a = " + "{b=" * 10**5 + "1" + "}" * 10**5 + "\n"
DEEP_KEY = "[defrag]\n" + ".".join(["a"] * 10**5) + " = 1\n"
"""tomllib takes time and memory quadratic in a dotted key's parts: minutes and over 20 GB for
these, so only a memory-bound process is given them."""
LONG_KEY = "[defrag]\n" + ".".join(["a"] * 1000) + " = 1\n"


def refused(path: Path | None, flags: dict[str, object] | None = None) -> str:
    """The one-line message `load_config` refuses the file at `path` (and `flags`) with."""
    with pytest.raises(ConfigError) as error:
        load_config(flags or {}, path)
    message = str(error.value)
    assert "\n" not in message
    return message


def agent(*args: str) -> subprocess.CompletedProcess[str]:
    """The real `kvctl-agent ARGS`, bounded in time and memory so that a regression fails
    instead of hanging the suite or filling the machine."""
    script = Path(sys.executable).with_name("kvctl-agent")
    command = (
        [str(script)] if script.exists() else [sys.executable, "-m", "kvctl.agent.startup.main"]
    )
    env = {k: v for k, v in os.environ.items() if k != "KVCTL_TOKEN"}

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30))

    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
        preexec_fn=limit_memory,
    )


def assert_refused(done: subprocess.CompletedProcess[str], *wanted: str) -> None:
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith("kvctl-agent: error: ")
    for text in wanted:
        assert text in lines[0]
    assert done.stdout == ""


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "agent.toml"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("flag", ["--config", "--token-file"])
def test_a_fifo_nobody_writes_is_refused_at_once(flag: str, fifo: Path) -> None:
    assert_refused(agent(flag, str(fifo)), f"{flag} {fifo}: not a regular file (a FIFO)")


SWAPPED_AFTER_STAT = """
import os, stat, sys
from pathlib import Path
from kvctl.agent.config import ConfigError, load_config
real_stat = os.stat
os.stat = lambda path: os.stat_result((stat.S_IFREG | 0o600, *real_stat(path)[1:]))
try:
    load_config({}, Path(sys.argv[1]))
except ConfigError as error:
    print(error)
"""
"""`load_config` on a FIFO that a regular file's `os.stat` saw: it is found out on the opened
descriptor, and the open does not wait for a writer."""


def test_a_fifo_swapped_in_after_the_check_is_refused_at_once(fifo: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SWAPPED_AFTER_STAT, str(fifo)],
        cwd=fifo.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout == f"--config {fifo}: not a regular file (a FIFO)\n", done.stderr


@pytest.mark.parametrize("flag", ["--config", "--token-file"])
def test_a_symlink_to_dev_zero_is_refused_without_reading(flag: str, tmp_path: Path) -> None:
    link = tmp_path / "agent.toml"
    link.symlink_to("/dev/zero")
    assert_refused(agent(flag, str(link)), f"{flag} {link}: not a regular file (a character")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (HUGE_ARRAY, ": larger than 1 MiB"),
        (DEEP_ARRAY, ": line 1: nested deeper than"),
        (DEEP_TABLE, ": line 1: nested deeper than"),
        (DEEP_KEY, ": line 2: nested deeper than"),
    ],
    ids=["huge-array", "array", "inline-table", "dotted-key"],
)
def test_deep_nesting_is_refused_by_the_command(text: str, why: str, tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    assert_refused(agent("--config", str(path)), f"--config {path}{why}")


def test_invalid_utf8_is_refused_by_the_command_with_its_offset(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_bytes(b'host = "127.0.0.1"\nlog_level = "\xff"\n')
    assert_refused(
        agent("--config", str(path)), f"--config {path}: not UTF-8 text (byte 0xff at offset 32)"
    )


def test_invalid_utf8_names_the_file_and_the_offset(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    text = b"# caf\xc3\xa9\n# \xc3(\n"
    path.write_bytes(text)
    offset = text.index(b"\xc3(")
    assert refused(path) == f"--config {path}: not UTF-8 text (byte 0xc3 at offset {offset})"


@pytest.mark.parametrize("text", [DEEP_ARRAY, DEEP_TABLE, LONG_KEY])
def test_deep_nesting_is_refused_before_parsing(text: str, tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    line = 2 if text == LONG_KEY else 1
    assert refused(path) == (
        f"--config {path}: line {line}: nested deeper than {MAX_CONFIG_DEPTH} levels "
        "(arrays, inline tables and the parts of dotted keys)"
    )


@pytest.mark.parametrize(
    "value",
    [
        "[" * MAX_CONFIG_DEPTH + "]" * MAX_CONFIG_DEPTH,
        "{b=" * MAX_CONFIG_DEPTH + "1" + "}" * MAX_CONFIG_DEPTH,
    ],
)
def test_nesting_up_to_the_cap_reaches_the_settings(value: str, tmp_path: Path) -> None:
    """Nesting up to the cap is parsed; the key is then refused as unknown, not as too deep."""
    path = tmp_path / "agent.toml"
    path.write_text(f"a = {value}\n")
    assert refused(path).endswith(
        ": a: unknown setting; see docs/settings.md (or `kvctl-agent --help`) for the valid ones"
    )


def test_brackets_in_strings_and_comments_do_not_count(tmp_path: Path) -> None:
    deep = "[{" * MAX_CONFIG_DEPTH
    path = tmp_path / "agent.toml"
    path.write_text(
        f"# {deep}\n"
        f'served_model_name = ["{deep}\\"{deep}", \'{deep}\', """\n{deep}"\\"""\n{deep}""",\n'
        f"  '''{deep}\n'{deep}'''''] # {deep}\n"
        f"alertmanager_basic_auth_user = '\\' # {deep}\n"
        "alertmanager_basic_auth_password_file = 'pw'\n"
        "defrag.enabled = false\n"
    )
    config = load_config({}, path)
    assert config.served_model_name[0] == f'{deep}"{deep}'
    assert config.served_model_name[2] == f'{deep}""""\n{deep}'
    assert config.served_model_name[3] == f"{deep}\n'{deep}''"
    assert config.alertmanager_basic_auth_user == "\\"
    assert config.settings == {"defrag": {"enabled": False}}


def test_a_directory_is_refused(tmp_path: Path) -> None:
    assert refused(tmp_path) == f"--config {tmp_path}: not a regular file (a directory)"


def test_a_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(path))
        assert refused(path) == f"--config {path}: not a regular file (a socket)"


def test_a_missing_or_unreadable_file_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "none.toml"
    assert refused(missing) == f"--config {missing}: No such file or directory"
    if os.geteuid() != 0:
        path = tmp_path / "agent.toml"
        path.write_text("port = 1\n")
        path.chmod(0)
        assert refused(path) == f"--config {path}: Permission denied"


def test_a_file_over_the_cap_is_refused_and_one_at_the_cap_is_read(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    line = "# " + "x" * 97 + "\n"
    body = 'served_model_name = ["capped"]\n'
    body += line * ((MAX_CONFIG_BYTES - len(body)) // len(line))
    path.write_text(body + "#" * (MAX_CONFIG_BYTES - len(body) - 1) + "\n")
    assert path.stat().st_size == MAX_CONFIG_BYTES
    assert load_config({}, path).served_model_name == ["capped"]
    with path.open("a") as more:
        more.write("\n")
    assert refused(path) == f"--config {path}: larger than 1 MiB, the most a config file may be"


def test_a_token_file_follows_the_same_rules(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_bytes(b"\xfe" * 8)
    message = refused(None, {"token_file": token})
    assert message == f"--token-file {token}: not UTF-8 text (byte 0xfe at offset 0)"
    assert refused(None, {"token_file": tmp_path}) == (
        f"--token-file {tmp_path}: not a regular file (a directory)"
    )


def test_more_models_than_the_bound_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    table = '[[models]]\nname = "m{}"\npath = "demo"\n'
    path.write_text("".join(table.format(i) for i in range(MAX_MODELS)))
    assert len(load_config({}, path).model_specs()) == MAX_MODELS
    path.write_text("".join(table.format(i) for i in range(MAX_MODELS + 1)))
    assert refused(path) == (
        f"--config {path}: models: at most {MAX_MODELS} models, not {MAX_MODELS + 1}"
    )
    flags = {"model": [f"m{i}=demo" for i in range(MAX_MODELS + 1)]}
    with pytest.raises(ConfigError, match=f"model: at most {MAX_MODELS} models, not 65"):
        load_config(flags)


def test_many_models_are_refused_by_the_command(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text("".join(f'[[models]]\nname = "m{i}"\n' for i in range(10_000)))
    assert_refused(agent("--config", str(path)), f"models: at most {MAX_MODELS} models, not 10000")


@pytest.mark.parametrize(
    "key", ["alertmanager_bearer_token_file", "alertmanager_basic_auth_password_file"]
)
def test_an_alertmanager_secret_file_follows_the_same_rules(
    key: str, fifo: Path, tmp_path: Path
) -> None:
    """These were read with `read_text()`: a FIFO there blocked the agent's start for good."""
    config = tmp_path / "agent.conf"
    user = "alertmanager_basic_auth_user = 'kvctl'\n" if "basic_auth" in key else ""
    config.write_text(f"alertmanager_url = 'http://127.0.0.1:9'\n{user}{key} = '{fifo}'\n")
    done = agent("--config", str(config), "--log-level", "error")  # read after the pool's log
    assert_refused(done, f"{key} {fifo}: not a regular file (a FIFO)")
