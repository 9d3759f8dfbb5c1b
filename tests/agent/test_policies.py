"""Automatic resize with an injected clock, and the agent's start-up configuration."""

import pytest

from kvctl.agent.autoresize import AutoResize
from kvctl.agent.config import AgentConfig, ConfigError, load_config
from kvctl.agent.observe.gpu import GpuProbe
from kvctl.agent.pool import PagePool
from kvctl.api import ResizeSettings


def stats(used: int, capacity: int = 64):
    pool = PagePool(capacity, 4, segment_pages=16, bytes_per_page=1000)
    if used:
        pool.allocate("load", used * 4)
    return pool.stats()


def test_grow_only_after_a_whole_window_above_the_high_water_mark() -> None:
    now = [0.0]
    policy = AutoResize(
        ResizeSettings(enabled=True, high_water=0.8, low_water=0.2, window_s=60, max_pages=96),
        lambda: now[0],
    )
    assert policy.decide(stats(60)) is None  # 0.94 > 0.8, window starts
    now[0] = 59.0
    assert policy.decide(stats(60)) is None
    now[0] = 60.0
    assert policy.decide(stats(60)) == 80  # one segment more
    now[0] = 61.0
    assert policy.decide(stats(60)) is None  # the window starts again after a resize
    now[0] = 130.0
    policy.decide(stats(60))
    now[0] = 200.0
    assert policy.decide(stats(60, capacity=96)) is None  # at the maximum


def test_a_dip_below_the_mark_restarts_the_window() -> None:
    now = [0.0]
    policy = AutoResize(ResizeSettings(enabled=True, window_s=10), lambda: now[0])
    policy.decide(stats(62))
    now[0] = 5.0
    policy.decide(stats(30))  # 0.47: neither mark
    now[0] = 12.0
    assert policy.decide(stats(62)) is None
    now[0] = 22.0
    assert policy.decide(stats(62)) == 80


def test_shrink_after_a_window_below_the_low_water_mark_down_to_the_minimum() -> None:
    now = [0.0]
    policy = AutoResize(
        ResizeSettings(enabled=True, low_water=0.3, window_s=30, min_pages=48), lambda: now[0]
    )
    assert policy.decide(stats(4)) is None
    now[0] = 30.0
    assert policy.decide(stats(4)) == 48
    now[0] = 100.0
    policy.decide(stats(4, capacity=48))
    now[0] = 200.0
    assert policy.decide(stats(4, capacity=48)) is None  # at the minimum


def test_grow_waits_for_device_memory_and_disabled_does_nothing() -> None:
    now = [0.0]
    settings = ResizeSettings(enabled=True, window_s=1)
    policy = AutoResize(settings, lambda: now[0])
    policy.decide(stats(62))
    now[0] = 2.0
    assert policy.decide(stats(62), spare_bytes=15 * 1000) is None  # a segment is 16 pages
    assert policy.decide(stats(62), spare_bytes=16 * 1000) == 80
    off = AutoResize(settings.model_copy(update={"enabled": False}), lambda: now[0])
    now[0] = 100.0
    assert off.decide(stats(62)) is None


def test_flags_override_the_toml_file(tmp_path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('port = 9000\npage-size = 32\npool_memory = "64MiB"\nalert_interval = "30s"\n')
    config = load_config({"port": 9100, "page_size": None, "alert_interval": None}, path)
    assert (config.port, config.page_size, config.pool_memory) == (9100, 32, 64 << 20)
    assert config.settings == {"alerts": {"interval_s": 30.0}}
    flagged = load_config({"alert_interval": "45s"}, path, ["alerts.for_s=2m"])
    assert flagged.settings == {"alerts": {"interval_s": 45.0, "for_s": 120.0}}


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("colour = 'blue'\n", "colour: unknown setting"),
        ("page_size = 0\n", "page_size"),
        ("port = 'http'\n", "port"),
        ("pool_pages = 4\npool_memory = '1GiB'\n", "give one of"),
        ("this is not toml", "not valid TOML"),
    ],
)
def test_bad_config_files_are_refused_with_one_line(tmp_path, toml, message) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=message) as error:
        load_config({}, path)
    assert "\n" not in str(error.value)


def test_public_bind_needs_a_token(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVCTL_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"refusing to listen on 0\.0\.0\.0"):
        load_config({"host": "0.0.0.0"})
    token = tmp_path / "token"
    token.write_text("abc\n")
    config = load_config({"host": "0.0.0.0", "token_file": token})
    assert config.token == "abc" and "abc" not in repr(config)
    monkeypatch.setenv("KVCTL_TOKEN", "from-env")
    assert load_config({"host": "::"}).token == "from-env"
    assert AgentConfig(host="::1").is_loopback


def test_gpu_probe_reports_absent_on_a_cpu_host() -> None:
    probe = GpuProbe()
    if probe.available:
        pytest.skip("this host has NVML")
    assert probe.read() == [] and probe.free_bytes(0) is None
