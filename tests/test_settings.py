"""The runtime settings' one definition: strict types, ranges, start-up limits, `null` defaults,
and the same rules through PATCH, TOML tables, `--set` and the named flags."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.agent.config import ConfigError, load_config
from kvctl.agent.startup.settings import render_settings_docs
from kvctl.settings import (
    FLAGS,
    SECTIONS,
    SPECS,
    RuntimeSettings,
    SettingsError,
    StartupLimits,
    apply_changes,
    from_text,
    render_markdown,
)

LIMITS = StartupLimits(segment_pages=16, max_pool_pages=1024)
DEFAULTS = LIMITS.defaults()


def change(changes: object) -> RuntimeSettings:
    return apply_changes(DEFAULTS, changes, DEFAULTS, LIMITS)


def test_the_defaults_in_force_fill_in_the_start_up_limits() -> None:
    assert (DEFAULTS.resize.min_pages, DEFAULTS.resize.max_pages) == (16, 1024)
    assert RuntimeSettings().resize.max_pages is None  # before the pool is sized


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"resize": {"max_pages": 2048}}, "resize.max_pages: must be at most 1024, the"),
        ({"resize": {"max_pages": 8, "min_pages": 1}}, "resize.max_pages: must be at least one"),
        ({"resize": {"min_pages": 1e30}}, "resize.min_pages: must be a whole number of pages"),
        ({"resize": {"min_pages": 64.0}}, "resize.min_pages: must be a whole number of pages"),
        ({"resize": {"min_pages": 2000}}, "resize.min_pages: must not exceed resize.max_pages"),
        ({"alerts": {"interval_s": 1e-9}}, "alerts.interval_s: must be a number of seconds in"),
        ({"alerts": {"interval_s": math.inf}}, "got Infinity"),
        ({"alerts": {"interval_s": math.nan}}, "got NaN"),
        ({"defrag": {"enabled": 1}}, "defrag.enabled: must be true or false, got 1"),
        ({"defrag": {"step_max_pages": True}}, "defrag.step_max_pages: must be a whole number"),
        ({"defrag": {"fragmentation_threshold": "0.4"}}, "must be a number in [0, 1]"),
        ({"defrag": {"fragmentation_target": 0.9}}, "must not exceed defrag.fragmentation_thr"),
        ({"prefix_cache": {"eviction_policy": "mru"}}, "must be one of lru, lfu, fifo"),
        ({"defrag": {"bogus": 1}}, "defrag.bogus: unknown setting; defrag has enabled"),
        ({"tuning": {}}, "tuning: unknown section; the sections are defrag, resize"),
        ({"defrag": 3}, "defrag: must be an object of settings"),
        ([1, 2], "body: must be an object of sections"),
    ],
)
def test_a_refused_change_names_the_key_and_what_it_accepts(changes, message) -> None:
    with pytest.raises(SettingsError) as refused:
        change(changes)
    assert str(refused.value).startswith(message) or message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_null_restores_the_default_in_force() -> None:
    lowered = change({"resize": {"max_pages": 512, "min_pages": 32}, "alerts": {"for_s": 5}})
    restored = apply_changes(
        lowered, {"resize": {"max_pages": None, "min_pages": None}}, DEFAULTS, LIMITS
    )
    assert (restored.resize.min_pages, restored.resize.max_pages) == (16, 1024)
    assert restored.alerts.for_s == 5  # untouched settings keep their value
    assert apply_changes(restored, {"alerts": {"for_s": None}}, DEFAULTS, LIMITS) == DEFAULTS


def scalar_values() -> st.SearchStrategy:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=5),
        st.sampled_from(["lru", "lfu", "fifo"]),
    )


@given(
    st.dictionaries(
        st.sampled_from([*SECTIONS, "other"]),
        st.dictionaries(st.sampled_from([s.name for s in SPECS.values()]), scalar_values()),
    )
)
def test_any_change_is_either_valid_in_full_or_refused(changes) -> None:
    """Whatever is sent, the result respects every range, every order and the start-up limits,
    or the change is refused; a value is never stored that reading back would break."""
    try:
        settings = change(changes)
    except SettingsError:
        return
    for spec in SPECS.values():
        value = getattr(getattr(settings, spec.section), spec.name)
        if spec.kind in ("int", "float") and value is not None:
            assert not isinstance(value, bool) and math.isfinite(value)
            assert spec.ge <= value <= spec.le, spec.key
        if spec.kind == "int" and value is not None:
            assert isinstance(value, int), spec.key
    assert settings.resize.max_pages <= LIMITS.max_pool_pages
    assert settings.resize.min_pages <= settings.resize.max_pages
    assert settings.resize.low_water < settings.resize.high_water
    assert RuntimeSettings.model_validate_json(settings.model_dump_json()) == settings


def test_text_values_from_the_command_line_read_by_type() -> None:
    assert from_text(
        {
            "defrag.enabled": "false",
            "defrag.check_interval_s": "250ms",
            "resize.max_pages": "512",
            "alerts.for_s": "2m",
            "resize.min_pages": "null",
            "prefix_cache.eviction_policy": "lfu",
        }
    ) == {
        "defrag": {"enabled": False, "check_interval_s": 0.25},
        "resize": {"max_pages": 512, "min_pages": None},
        "alerts": {"for_s": 120.0},
        "prefix_cache": {"eviction_policy": "lfu"},
    }
    with pytest.raises(SettingsError, match=r"defrag\.enabled: must be true or false, got 'yes'"):
        from_text({"defrag.enabled": "yes"})
    with pytest.raises(SettingsError, match=r"resize\.max_pages: must be a whole number"):
        from_text({"resize.max_pages": "lots"})


def test_every_flag_of_a_setting_is_an_option_of_the_agent() -> None:
    import typer

    from kvctl.agent.startup.main import app

    options = {
        option: param.help for param in typer.main.get_command(app).params for option in param.opts
    }
    for flag, spec in FLAGS.items():
        assert spec.key in options[flag] and spec.help in options[flag]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


def test_the_prefix_cache_switch_is_not_its_settings_table(tmp_path) -> None:
    off = load_config({"prefix_cache": None}, write(tmp_path, "prefix_cache = false\n"))
    assert off.prefix_cache is False and off.settings == {}
    table = load_config({}, write(tmp_path, "[prefix_cache]\neviction_policy = 'lfu'\n"))
    assert table.prefix_cache is True
    assert table.settings == {"prefix_cache": {"eviction_policy": "lfu"}}
    assert load_config({"prefix_cache": False}).prefix_cache is False


def test_toml_tables_named_flags_and_set_layer_in_that_order(tmp_path) -> None:
    path = write(
        tmp_path,
        "alert_interval = '30s'\n"
        "[defrag]\nfragmentation_threshold = 0.4\ncheck_interval_s = '2s'\n"
        "[alerts]\ninterval_s = 20\nfor_s = 10\n",
    )
    config = load_config({"alert_for": "45s"}, path, ["defrag.fragmentation_threshold=0.3"])
    assert config.settings == {
        "defrag": {"fragmentation_threshold": 0.3, "check_interval_s": 2.0},
        "alerts": {"interval_s": 30.0, "for_s": 45.0},
    }


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("token = 'hunter2'\n", "token: do not write the token into the config file"),
        ("[defrag]\nbogus = 1\n", "defrag.bogus: unknown setting"),
        ("[defrag]\nenabled = 1\n", "defrag.enabled: must be true or false"),
        ("[tuning]\nx = 1\n", "tuning: unknown setting"),
        ("[alerts]\ninterval_s = 'soon'\n", "alerts.interval_s: must be a number of seconds"),
        ("advertise_url = 'http://[::]:8477'\n", "wildcard address"),
        ("advertise_url = 'node-1:8477'\n", r"must be an http\(s\) URL"),
        ("max_waiting = 0\n", "max_waiting"),
        ("header_timeout = '0s'\n", "header_timeout: must be a positive duration"),
        ("runbook_url = 'docs/alerts.md'\n", "runbook_url: must be an absolute http"),
        ("prometheus_job = ' '\n", "prometheus_job: must name the job"),
    ],
)
def test_bad_settings_in_the_file_are_refused_with_one_line(tmp_path, toml, message) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        load_config({}, write(tmp_path, toml))
    assert "\n" not in str(refused.value)


def test_the_advertised_url_is_never_a_wildcard(monkeypatch) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "gpu-node-7")
    assert load_config({"host": "127.0.0.1"}).advertised(8477) == "http://127.0.0.1:8477"
    monkeypatch.setenv("KVCTL_TOKEN", "t")
    assert load_config({"host": "0.0.0.0"}).advertised(9000) == "http://gpu-node-7:9000"
    given_url = load_config({"host": "0.0.0.0", "advertise_url": "https://kv.example:443/"})
    assert given_url.advertised(9000) == "https://kv.example:443"


def test_the_settings_docs_are_generated_from_the_definition() -> None:
    docs = Path(__file__).parent.parent / "docs" / "settings.md"
    assert docs.read_text() == render_settings_docs(), (
        "docs/settings.md is stale: python -m kvctl.agent.startup.settings_docs > docs/settings.md"
    )
    for key in SPECS:
        assert f"`{key}`" in render_markdown()
