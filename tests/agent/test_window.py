"""CounterRatioWindow: ratios of counter increases over the last window, with a fake clock."""

from kvctl.agent.observe.window import CounterRatioWindow


def test_ratio_covers_only_the_window() -> None:
    now = [0.0]
    window = CounterRatioWindow(window=10.0, clock=lambda: now[0])
    assert window.ratio() is None  # nothing attempted yet
    now[0] = 1.0
    window.record(9, 10)  # 9 of 10 succeeded
    assert window.ratio() == 0.9
    now[0] = 5.0
    window.record(19, 20)  # 10 more, all succeeded
    assert window.ratio() == 19 / 20
    now[0] = 12.0
    window.record(29, 30)  # the sample at t=1 is now the baseline (t=0 fell out)
    assert window.ratio() == 20 / 20
    now[0] = 30.0
    window.record(29, 30)  # nothing happened in the last 10 s
    assert window.ratio() is None


def test_frequent_readings_are_coalesced() -> None:
    now = [0.0]
    window = CounterRatioWindow(window=100.0, clock=lambda: now[0], resolution=1.0)
    for i in range(1, 1001):
        now[0] = i * 0.01
        window.record(i, i)
    assert len(window._samples) <= 12
    assert window.ratio() == 1.0
