"""Sizes and durations as operators write them."""

import pytest

from kvctl.units import format_bytes, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("512MiB", 512 << 20),
        ("8GiB", 8 << 30),
        ("1.5GB", 1_500_000_000),
        ("2 gib", 2 << 30),
        ("10k", 10_000),
    ],
)
def test_parse_size(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "8 parsecs", "-1", "1e9", "8GiBs"])
def test_parse_size_refuses_with_a_hint(text) -> None:
    with pytest.raises(ValueError, match="8GiB"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("15s", 15.0), ("1m", 60.0), ("500ms", 0.5), ("2h", 7200.0), ("30", 30.0)],
)
def test_parse_duration(text, expected) -> None:
    assert parse_duration(text) == expected


def test_parse_duration_refuses_with_a_hint() -> None:
    with pytest.raises(ValueError, match="15s"):
        parse_duration("soon")


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1536, 8 << 30)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "8 GiB",
    ]


def test_format_bytes_never_falls_back_to_exponents() -> None:
    assert format_bytes(1000 << 30) == "1000 GiB"
    assert format_bytes(1023 * (1 << 20)) == "1023 MiB"
    assert format_bytes(2048 << 40) == "2048 TiB"
