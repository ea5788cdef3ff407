"""The check every bad-input test shares: a SpecError whose message is one line naming what it must."""

from __future__ import annotations

from typing import Callable, Iterable

import pytest

from harness.spec import SpecError


def assert_one_line_error(call: Callable[[], object], words: Iterable[str]) -> None:
    with pytest.raises(SpecError) as raised:
        call()
    message = str(raised.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
