"""The start-up settings' one definition (the fields of AgentConfig): every setting has one
key, at most one flag (a few are file-only), a docs entry, and a help that shows the default it
is defined with; a flag and the same TOML key give the same configuration. Runs the command
in-process without serving (no torch)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import kvctl.agent.startup.main as agent_main
from kvctl.agent.config import (
    FLAG_KEYS,
    STARTUP_KEYS,
    AgentConfig,
    ConfigError,
    load_config,
    toml_keys,
)
from kvctl.agent.startup.settings import (
    FLAGS,
    SPECS,
    format_duration,
    format_size,
    render_settings_docs,
    render_startup_markdown,
)
from kvctl.settings import FLAGS as RUNTIME_FLAGS
from kvctl.units import parse_duration, parse_size

DOCS = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
NOT_SETTINGS = {"settings", "token"}  # filled in by load_config: no flag, no TOML key
COMMAND_OPTIONS = {"--config", "--set", "--version", "--help"}

# Every option `kvctl-agent --help` listed before the options were generated: none may go.
FLAGS_BEFORE = [
    "--host",
    "--port",
    "--model",
    "--served-model-name",
    "--device",
    "--dtype",
    "--page-size",
    "--pool-pages",
    "--pool-memory",
    "--gpu-memory-fraction",
    "--kv-budget",
    "--segment-pages",
    "--max-pool-pages",
    "--max-pinned-share",
    "--sleep-when-idle",
    "--idle-sleep-level",
    "--prefix-cache",
    "--no-prefix-cache",
    "--prefix-isolation",
    "--window-pages",
    "--eviction-policy",
    "--host-tier-memory",
    "--host-tier-policy",
    "--disk-tier-path",
    "--disk-tier-size",
    "--disk-tier-policy",
    "--torch-threads",
    "--decode-read-path",
    "--max-batch-seqs",
    "--max-batched-tokens",
    "--max-batch-tokens",
    "--long-prompt-tokens",
    "--max-prefill-while-decoding",
    "--max-waiting",
    "--advertise-url",
    "--prometheus-job",
    "--runbook-url",
    "--report-cached-tokens",
    "--no-report-cached-tokens",
    "--kv-events-endpoint",
    "--kv-events-replay-endpoint",
    "--kv-events-topic",
    "--token-file",
    "--alertmanager-url",
    "--alert-interval",
    "--alert-for",
    "--stats-window",
    "--log-level",
    "--config",
    "--set",
    "--version",
    "--help",
]


def command_options() -> dict[str, Any]:
    """Every option name of `kvctl-agent` -> its click parameter."""
    command = typer.main.get_command(agent_main.app)
    options: dict[str, Any] = {}
    for param in command.params:
        for name in [*param.opts, *param.secondary_opts]:
            assert name not in options, f"{name} is declared twice"
            options[name] = param
    options["--help"] = None
    return options


def test_every_field_is_one_setting_with_one_key() -> None:
    assert set(AgentConfig.model_fields) - NOT_SETTINGS == set(SPECS) == set(STARTUP_KEYS)
    assert list(SPECS) == list(STARTUP_KEYS)
    assert set(SPECS) <= toml_keys()
    assert not NOT_SETTINGS & toml_keys()
    for spec in SPECS.values():
        assert spec.help, f"{spec.key} has no help"
        for flag in spec.flags:
            assert flag == "--" + flag.removeprefix("--").replace("_", "-")


def test_every_flagged_setting_has_exactly_one_option_and_nothing_else_is_one() -> None:
    options = command_options()
    params = [p for p in typer.main.get_command(agent_main.app).params]
    by_name = {p.name: p for p in params}
    for spec in SPECS.values():
        if not spec.flags:
            assert spec.key not in by_name, f"{spec.key} is file-only but has an option"
            continue
        param = by_name[spec.key]
        assert tuple(param.opts) == spec.flags
        assert sum(1 for p in params if p.name == spec.key) == 1
    expected = set(FLAGS) | set(RUNTIME_FLAGS) | COMMAND_OPTIONS
    expected |= {f"--no-{s.flags[0][2:]}" for s in SPECS.values() if s.cli_type is bool and s.flags}
    assert set(options) == expected


def test_no_flag_of_before_is_lost_and_none_added() -> None:
    assert sorted(command_options()) == sorted(FLAGS_BEFORE)


def test_the_help_of_each_flag_shows_the_default_of_its_definition() -> None:
    by_name = {p.name: p for p in typer.main.get_command(agent_main.app).params}
    defaults = AgentConfig()
    for spec in SPECS.values():
        if not spec.flags:
            continue
        help_text = by_name[spec.key].help
        assert help_text == spec.option_help()
        shown = re.search(r"\(default ([^()]*(?:\([^()]*\)[^()]*)*)\)\.$", help_text)
        assert shown is not None, f"{spec.flag}: no default in {help_text!r}"
        assert shown.group(1) == spec.default_text
        value = getattr(defaults, spec.key)
        if spec.default is None or "default_text" in _extra(spec.key):
            continue  # resolved at start-up: the definition says how, in words
        if isinstance(value, bool):
            assert spec.default_text == ("on" if value else "off")
        elif isinstance(value, list):
            assert spec.default_text == ", ".join(value)
        elif _extra(spec.key)["unit"] == "bytes":
            assert parse_size(spec.default_text) == value
        elif _extra(spec.key)["unit"] == "seconds":
            assert parse_duration(spec.default_text) == value
        else:
            assert spec.default_text == str(value)
    for flag, spec in RUNTIME_FLAGS.items():
        param = next(p for p in by_name.values() if flag in p.opts)
        assert f"Sets {spec.key} (default {spec.default})." in param.help


def _extra(key: str) -> dict[str, Any]:
    extra = AgentConfig.model_fields[key].json_schema_extra
    assert isinstance(extra, dict)
    startup = extra["startup"]
    assert isinstance(startup, dict)
    return startup


def test_the_docs_are_generated_and_list_every_setting() -> None:
    assert DOCS.read_text() == render_settings_docs(), (
        "docs/settings.md is stale: python -m kvctl.agent.startup.settings_docs > docs/settings.md"
    )
    part = render_startup_markdown().partition("## `[[models]]` tables")[0]
    for spec in SPECS.values():
        rows = [line for line in part.splitlines() if line.startswith(f"| `{spec.key}` |")]
        assert len(rows) == 1, spec.key
        assert spec.default_text.replace("|", "\\|") in rows[0]
        for flag in spec.flags:
            assert f"`{flag}`" in rows[0]


def test_sizes_and_durations_are_shown_as_a_flag_takes_them() -> None:
    assert format_size(10 << 30) == "10GiB" and format_size(0) == "0"
    assert format_size(1536) == "1536" and format_size(3 << 20) == "3MiB"
    assert format_duration(300) == "5m" and format_duration(10) == "10s"
    assert format_duration(0.5) == "500ms" and format_duration(7200) == "2h"


# ---- a flag and the same TOML key -------------------------------------------------------------

# For every flagged setting: (flag arguments, the same as TOML, settings both need beside it).
SAMPLES: dict[str, tuple[list[str], str, dict[str, Any]]] = {
    "host": (["--host", "localhost"], 'host = "localhost"', {}),
    "port": (["--port", "9001"], "port = 9001", {}),
    "model": (
        ["--model", "a=demo", "--model", "b=demo:8x2"],
        'model = ["a=demo", "b=demo:8x2"]',
        {},
    ),
    "served_model_name": (
        ["--served-model-name", "x", "--served-model-name", "y"],
        'served_model_name = ["x", "y"]',
        {},
    ),
    "device": (["--device", "cuda:1"], 'device = "cuda:1"', {}),
    "dtype": (["--dtype", "bfloat16"], 'dtype = "bfloat16"', {}),
    "page_size": (["--page-size", "32"], "page_size = 32", {}),
    "pool_pages": (["--pool-pages", "77"], "pool_pages = 77", {}),
    "pool_memory": (["--pool-memory", "2MiB"], 'pool_memory = "2MiB"', {}),
    "gpu_memory_fraction": (
        ["--gpu-memory-fraction", "0.5"],
        "gpu_memory_fraction = 0.5",
        {"device": "cuda"},
    ),
    "kv_budget": (["--kv-budget", "12GiB"], 'kv_budget = "12GiB"', {}),
    "segment_pages": (["--segment-pages", "4"], "segment_pages = 4", {}),
    "max_pool_pages": (["--max-pool-pages", "4096"], "max_pool_pages = 4096", {}),
    "prefix_cache": (["--no-prefix-cache"], "prefix_cache = false", {}),
    "prefix_isolation": (["--prefix-isolation", "sampling"], 'prefix_isolation = "sampling"', {}),
    "window_pages": (["--window-pages", "keep"], 'window_pages = "keep"', {}),
    "host_tier_memory": (["--host-tier-memory", "8GiB"], 'host_tier_memory = "8GiB"', {}),
    "disk_tier_path": (["--disk-tier-path", "/tmp/kv"], 'disk_tier_path = "/tmp/kv"', {}),
    "disk_tier_size": (
        ["--disk-tier-size", "1GiB"],
        'disk_tier_size = "1GiB"',
        {"disk_tier_path": "/tmp/kv"},
    ),
    "torch_threads": (["--torch-threads", "3"], "torch_threads = 3", {}),
    "decode_read_path": (["--decode-read-path", "gather"], 'decode_read_path = "gather"', {}),
    "max_batch_seqs": (["--max-batch-seqs", "8"], "max_batch_seqs = 8", {}),
    "max_batched_tokens": (["--max-batch-tokens", "512"], "max_batch_tokens = 512", {}),
    "long_prompt_tokens": (["--long-prompt-tokens", "100"], "long_prompt_tokens = 100", {}),
    "max_prefill_while_decoding": (
        ["--max-prefill-while-decoding", "64"],
        "max_prefill_while_decoding = 64",
        {},
    ),
    "max_waiting": (["--max-waiting", "9"], "max_waiting = 9", {}),
    "advertise_url": (
        ["--advertise-url", "http://node:1/"],
        'advertise_url = "http://node:1/"',
        {},
    ),
    "prometheus_job": (["--prometheus-job", "kv"], 'prometheus_job = "kv"', {}),
    "runbook_url": (["--runbook-url", "https://w/x"], 'runbook_url = "https://w/x"', {}),
    "report_cached_tokens": (["--report-cached-tokens"], "report_cached_tokens = true", {}),
    "kv_events_endpoint": (
        ["--kv-events-endpoint", "tcp://127.0.0.1:0"],
        'kv_events_endpoint = "tcp://127.0.0.1:0"',
        {},
    ),
    "kv_events_replay_endpoint": (
        ["--kv-events-replay-endpoint", "tcp://127.0.0.1:5558"],
        'kv_events_replay_endpoint = "tcp://127.0.0.1:5558"',
        {"kv_events_endpoint": "tcp://127.0.0.1:5557"},
    ),
    "kv_events_topic": (["--kv-events-topic", "kv@{model}"], 'kv_events_topic = "kv@{model}"', {}),
    "token_file": (["--token-file", "TOKEN"], 'token_file = "TOKEN"', {}),
    "alertmanager_url": (
        ["--alertmanager-url", "http://am:9093"],
        'alertmanager_url = "http://am:9093"',
        {},
    ),
    "stats_window": (["--stats-window", "2m"], 'stats_window = "2m"', {}),
    "log_level": (["--log-level", "debug"], 'log_level = "debug"', {}),
}


def run_command(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, Any]:
    """`kvctl-agent ARGS` in-process, stopping where it would serve: (exit code, stderr, the
    configuration it would have served)."""
    served: list[AgentConfig] = []

    def serve(config: AgentConfig) -> int:
        served.append(config)
        return 0

    monkeypatch.setattr(agent_main, "serve", serve)
    monkeypatch.setattr(agent_main.logging, "basicConfig", lambda **_: None)
    monkeypatch.delenv("KVCTL_TOKEN", raising=False)
    result = CliRunner().invoke(agent_main.app, args, env={"COLUMNS": "160"})
    return result.exit_code, result.stderr, served[0] if served else None


def test_every_flagged_setting_has_a_sample() -> None:
    assert set(SAMPLES) == {spec.key for spec in SPECS.values() if spec.flags}


@pytest.mark.parametrize("key", list(SAMPLES))
def test_a_flag_and_its_toml_key_give_the_same_config(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "TOKEN").write_text("secret\n")
    args, toml, beside = SAMPLES[key]
    context = "".join(f"{k} = {_toml(v)}\n" for k, v in beside.items())
    (tmp_path / "beside.toml").write_text(context)
    (tmp_path / "agent.toml").write_text(context + toml + "\n")
    code, stderr, from_flag = run_command([*args, "--config", "beside.toml"], monkeypatch)
    assert code == 0, stderr
    from_file = load_config({}, tmp_path / "agent.toml")
    assert from_flag == from_file
    assert from_flag != load_config({}, tmp_path / "beside.toml"), (
        f"{key}: the sample changes nothing"
    )


def _toml(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value).lower()


def test_a_runtime_flag_and_its_flat_key_give_the_same_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert set(FLAG_KEYS) <= toml_keys()
    (tmp_path / "agent.toml").write_text('alert_interval = "30s"\neviction_policy = "lfu"\n')
    code, stderr, config = run_command(
        ["--alert-interval", "30s", "--eviction-policy", "lfu"], monkeypatch
    )
    assert code == 0, stderr
    assert config.settings == load_config({}, tmp_path / "agent.toml").settings


def test_a_flag_wins_over_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "agent.toml"
    path.write_text("page_size = 32\nmax_waiting = 7\n")
    code, _, config = run_command(["--config", str(path), "--page-size", "64"], monkeypatch)
    assert code == 0 and (config.page_size, config.max_waiting) == (64, 7)
    code, _, config = run_command(["--config", str(path)], monkeypatch)
    assert code == 0 and config.page_size == 32 and config.model == ["demo"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dtype", "float8"], "kvctl-agent: error: kvctl-agent: dtype: Input should be"),
        (["--pool-memory", "lots"], "kvctl-agent: error: kvctl-agent: pool_memory:"),
        (["--stats-window", "0s"], "kvctl-agent: error: kvctl-agent: stats_window: must be"),
        (["--pool-pages", "4", "--pool-memory", "1MiB"], "give one of --pool-pages"),
        (["--port", "70000"], "kvctl-agent: error: kvctl-agent: port: Input should be less"),
        (["--alert-interval", "soon"], "alerts.interval_s: must be"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, stderr, config = run_command(args, monkeypatch)
    assert code == 2 and config is None
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], stderr


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("colour = 'blue'\n", "colour: unknown setting; see docs/settings.md"),
        ("settings = {}\n", "settings: unknown setting"),
        ("token = 'x'\n", "token: do not write the token into the config file"),
        ("max_batch_tokens = 8\nmax_batched_tokens = 9\n", "another name of max_batched_tokens"),
    ],
)
def test_the_file_takes_only_the_defined_keys(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        load_config({}, path)
    assert "\n" not in str(refused.value)


def test_file_only_settings_are_read_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('shutdown_grace = "1m"\nmax_connections = 64\nseed = 3\n')
    config = load_config({}, path)
    assert (config.shutdown_grace, config.max_connections, config.seed) == (60.0, 64, 3)
