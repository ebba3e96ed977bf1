import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgwctl.catalog import format_duration, parse_duration


@pytest.mark.parametrize("text,seconds", [
    ("30s", 30), ("15m", 900), ("1h30m", 5400), ("2d", 172800), ("500ms", 0.5), ("90", 90), (0, 0), (2.5, 2.5),
    (" 1H ", 3600),
])
def test_parse(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["15 minutes", "", "m", "1h 30m", "-5s", -1, True, None, [1], "1x"])
def test_unparseable_durations_say_what_was_expected(bad):
    with pytest.raises(ValueError, match="expected a duration like 30s, 15m, 1h30m or 2d"):
        parse_duration(bad)


@given(st.integers(min_value=0, max_value=10**8) | st.integers(min_value=0, max_value=10**6).map(lambda ms: ms / 1000))
def test_format_parses_back_exactly(seconds):
    assert parse_duration(format_duration(seconds)) == seconds


def test_format_is_what_an_operator_would_write():
    assert format_duration(5400) == "1h30m"
    assert format_duration(900) == "15m"
    assert format_duration(0.25) == "250ms"
