"""A strategy option: its default, the values it takes, what it does, and the one-line refusal of a bad value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from harness.spec import OptionValue, SpecError


@dataclass(frozen=True)
class Option:
    """A strategy option: its default, the values it takes, and what it does."""

    default: OptionValue
    help: str
    choices: tuple[OptionValue, ...] | None = None   # allowed values, or None for any of `default`'s type
    minimum: float | None = None
    # For values of a form rather than a list (`every:K`): reads one, raising SpecError in one line if it is not.
    parse: Callable[[OptionValue], Any] | None = None

    def given(self, value: OptionValue) -> OptionValue:
        """A value as the command line gave it, in this option's own form: `=none` arrives as None (the command line
        reads none and null so), which is the word "none" for an option whose values are words and take it."""
        if value is not None or None in (self.choices or ()):
            return value
        takes_none = "none" in (self.choices or ()) if self.parse is None else _parses(self.parse, "none")
        return "none" if takes_none else value

    def check(self, strategy: str, name: str, value: OptionValue) -> None:
        if self.parse is not None:
            self.parse(value)
            return
        if self.choices is not None:
            if value not in self.choices:
                allowed = ", ".join(str(c) for c in self.choices)
                raise SpecError(f"option {name}={value!r} of strategy {strategy} is not one of: {allowed}")
            return
        expected = type(self.default)
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise SpecError(f"option {name} of strategy {strategy} takes a {expected.__name__}, got {value!r}")
        if self.minimum is not None and value < self.minimum:
            raise SpecError(f"option {name} of strategy {strategy} must be >= {self.minimum}, got {value!r}")


def _parses(parse: Callable[[OptionValue], Any], value: OptionValue) -> bool:
    try:
        parse(value)
    except SpecError:
        return False
    return True
