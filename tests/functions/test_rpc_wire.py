"""The wire between a program and its tests (``functions.verifiers.rpc``), without a sandbox:
stdlib values that travel by value, what stays a handle, malformed values refused."""

from __future__ import annotations

import collections
import datetime
import json
from typing import Any

import pytest

from functions.verifiers import rpc


def across(value: Any, exact: bool = True) -> Any:
    """``value`` encoded as the program's side (``exact``) or the tests' side encodes it, through
    JSON, and decoded; a handle decodes as ``("handle", type name)``."""
    encoded = rpc.Encoder(lambda v: ["h", 0, None, type(v).__name__], exact=exact).encode(value)
    return rpc.Decoder(lambda h: ("handle", h[3])).decode(json.loads(json.dumps(encoded)))


class Plus5(datetime.tzinfo):
    def utcoffset(self, dt):
        return datetime.timedelta(hours=5)


UTC, IST = datetime.UTC, datetime.timezone(datetime.timedelta(hours=5, minutes=30), "IST")
STDLIB_VALUES = {
    "date": datetime.date(2020, 2, 29),
    "date_min": datetime.date.min,
    "datetime": datetime.datetime(2020, 1, 2, 3, 4, 5, 6),
    "datetime_utc": datetime.datetime(1999, 12, 31, 23, 59, 59, tzinfo=UTC),
    "datetime_named_offset_fold": datetime.datetime(2021, 11, 7, 1, 30, tzinfo=IST, fold=1),
    "time": datetime.time(12, 30, 0, 999_999),
    "time_with_offset": datetime.time(1, 2, tzinfo=datetime.timezone(-datetime.timedelta(hours=3))),
    "timedelta": datetime.timedelta(days=-3, seconds=5, microseconds=7),
    "timedelta_max": datetime.timedelta.max,
    "deque": collections.deque([1, [2, 3], "x"]),
    "deque_maxlen": collections.deque([datetime.date(2020, 1, 1)], maxlen=2),
    "deque_maxlen_zero": collections.deque(maxlen=0),
    "range": range(0, 3**50, 7),
    "range_negative_step": range(10, -10, -3),
    "nested": {"when": [datetime.date(2020, 1, 1), (range(3), collections.deque())]},
}


@pytest.mark.parametrize("value", STDLIB_VALUES.values(), ids=STDLIB_VALUES.keys())
def test_stdlib_value_types_travel_by_value(value):
    for exact in (True, False):  # from the program, and from the tests
        back = across(value, exact)
        assert back == value and type(back) is type(value)
    if isinstance(value, datetime.datetime | datetime.time):
        assert (back.tzinfo, back.fold) == (value.tzinfo, value.fold)
        assert back.tzname() == value.tzname()
    if isinstance(value, collections.deque):
        assert back.maxlen == value.maxlen


def test_what_stays_a_handle():
    # a tzinfo of the program's own, a subclass (from the program, which keeps its behaviour)
    assert across(datetime.datetime(2020, 1, 1, tzinfo=Plus5())) == ("handle", "datetime")
    assert across(datetime.time(1, tzinfo=Plus5())) == ("handle", "time")

    class Stamp(datetime.date):
        pass

    class Window(collections.deque):
        pass

    assert across(Stamp(2020, 1, 1)) == ("handle", "Stamp")
    assert across(Window([1])) == ("handle", "Window")
    # the tests' own subclasses go to the program as their stdlib type
    assert type(across(Stamp(2020, 1, 1), exact=False)) is datetime.date
    assert across(Window([1], maxlen=4), exact=False) == collections.deque([1], maxlen=4)


MALFORMED = {
    "month_13": ["date", 2020, 13, 1],
    "feb_30": ["date", 2021, 2, 30],
    "year_0": ["date", 0, 1, 1],
    "bool_field": ["date", 2020, 1, True],
    "float_field": ["date", 2020.0, 1, 1],
    "huge_year": ["date", 10**30, 1, 1],
    "missing_field": ["date", 2020, 1],
    "hour_24": ["time", 24, 0, 0, 0, 0, None],
    "microsecond_1e6": ["time", 0, 0, 0, 1_000_000, 0, None],
    "fold_2": ["dt", 2020, 1, 1, 0, 0, 0, 0, 2, None],
    "offset_a_day": ["dt", 2020, 1, 1, 0, 0, 0, 0, 0, [1, 0, 0, None]],
    "tz_name_not_str": ["time", 0, 0, 0, 0, 0, [0, 60, 0, 5]],
    "tz_not_list": ["time", 0, 0, 0, 0, 0, "UTC"],
    "timedelta_seconds_a_day": ["td", 0, 86_400, 0],
    "timedelta_negative_us": ["td", 0, 0, -1],
    "timedelta_too_many_days": ["td", 10**9, 0, 0],
    "deque_over_maxlen": ["dq", [1, 2], 1],
    "deque_negative_maxlen": ["dq", [], -1],
    "deque_float_maxlen": ["dq", [], 1.0],
    "deque_items_not_list": ["dq", {"a": 1}, None],
    "range_step_0": ["r", 0, 1, 0],
    "range_float": ["r", 0, 1.5, 1],
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_stdlib_values_are_protocol_errors(raw):
    with pytest.raises(rpc.ProtocolError, match="a malformed"):
        rpc.Decoder(lambda h: h).decode(raw)
