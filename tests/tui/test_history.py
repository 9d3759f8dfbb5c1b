"""The sparklines' history: the whole session in bounded memory, drawn over a time window."""

from __future__ import annotations

from kvctl.tui.history import History

UTIL, SUCCESS = "utilization_ratio", "alloc_success_ratio"


def at_util(fakes, used: int):
    """A pool whose utilisation is (used + 83 cached) / 256."""
    return fakes.reading(used_pages=used, free_pages=173 - used).pool


def test_a_week_of_polls_stays_small_and_keeps_its_start(fakes) -> None:
    history = History(hold=2.0, level_size=64, factor=4)
    pool = at_util(fakes, 10)
    for second in range(7 * 24 * 3600 // 10):  # a week at one reading per 10 s
        history.add(pool, 10.0 * second)
    assert len(history) == 60_480
    assert len(history.buckets()) <= 64 * 8  # log4(60480 / 64) < 5 levels of at most 64 + 3
    assert history.start == 0.0
    now = 10.0 * (60_480 - 1)
    whole = history.bars(UTIL, 20, now, None)
    assert None not in whole  # every slice of the week has its reading


def test_recent_readings_keep_full_resolution(fakes) -> None:
    history = History(hold=1.5, level_size=64, factor=4)
    for second in range(10_000):
        history.add(at_util(fakes, 10 + second % 2 * 100), float(second))
    # the last minute, one bar per second: alternating low and high as read
    bars = history.bars(UTIL, 60, 9_999.0, 60.0)
    assert [round(bar, 2) for bar in bars[-4:]] == [0.36, 0.75, 0.36, 0.75]


def test_a_bar_keeps_the_worst_reading_of_its_slice(fakes) -> None:
    history = History()
    for second, success in enumerate([1.0, 1.0, 0.5, 1.0, 1.0, 1.0]):
        history.add(fakes.reading(alloc_success_ratio=success).pool, float(second))
    assert history.bars(SUCCESS, 2, 5.0, None) == [0.5, 1.0]  # the dip at t=2 is not averaged
    assert history.bars(SUCCESS, 1, 5.0, None) == [0.5]


def test_the_dip_survives_downsampling(fakes) -> None:
    history = History(level_size=16, factor=4)
    for second in range(2_000):
        success = 0.2 if second == 100 else 1.0
        history.add(fakes.reading(alloc_success_ratio=success).pool, float(second))
    assert len(history.buckets()) < 100
    assert min(b for b in history.bars(SUCCESS, 10, 1_999.0, None) if b is not None) == 0.2


def test_a_window_longer_than_the_session_is_empty_on_the_left(fakes) -> None:
    history = History()
    for second in range(5):
        history.add(at_util(fakes, 10), float(second))
    bars = history.bars(UTIL, 12, 4.0, 60.0)  # 5 s per bar: the readings fill the last one
    assert bars[:-1] == [None] * 11 and bars[-1] is not None


def test_silence_longer_than_hold_is_a_gap(fakes) -> None:
    history = History(hold=2.0)
    for second in (0, 1, 2, 8, 9, 10):  # the agent did not answer from 3 to 7
        history.add(at_util(fakes, 10), float(second))
    drawn = [bar is not None for bar in history.bars(UTIL, 10, 10.0, None)]  # a bar a second
    assert drawn[:2] == [True, True] and drawn[3:7] == [False] * 4 and drawn[-2:] == [True, True]


def test_nothing_read_draws_nothing(fakes) -> None:
    assert History().bars(UTIL, 5, 100.0, 60.0) == [None] * 5
    history = History()
    history.add(at_util(fakes, 10), 100.0)
    assert history.bars(UTIL, 3, 100.0, None) == [None, None, history.buckets()[0].values[2]]
