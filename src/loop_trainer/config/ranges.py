"""The values a numeric setting allows, declared on the field itself and checked in one place.

A field declares its range where it is declared (``x: int = setting(1, "help", at_least(1, "what x does"))``);
:func:`check_ranges` checks every field of a settings object that declares one, so
``LOOPConfig``, ``loop-eval``'s arguments and ``loop-train``'s script arguments refuse a value outside its
range with the same one line: the key, the allowed values, the value given, and what the key does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Interval",
    "Range",
    "SettingField",
    "above",
    "any_number",
    "at_least",
    "between",
    "check_ranges",
    "range_of",
    "setting",
    "steps_or_fraction",
]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


@dataclass(frozen=True)
class Interval:
    """Finite numbers between two bounds (each closed unless ``*_open``); ``whole``: integers only."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    whole: bool = False

    def __contains__(self, value: Any) -> bool:
        if not (_is_number(value) and math.isfinite(value)) or (self.whole and not float(value).is_integer()):
            return False
        above_low = value > self.low if self.low_open else value >= self.low
        below_high = value < self.high if self.high_open else value <= self.high
        return above_low and below_high

    def __str__(self) -> str:
        if self.low == -math.inf and self.high == math.inf:
            text = "a number"
        elif self.high == math.inf:
            text = f"{'>' if self.low_open else '>='} {_shown(self.low)}"
        elif self.low == -math.inf:
            text = f"{'<' if self.high_open else '<='} {_shown(self.high)}"
        else:
            text = (
                f"in {'(' if self.low_open else '['}{_shown(self.low)}, {_shown(self.high)}"
                f"{')' if self.high_open else ']'}"
            )
        return f"a whole number {text}" if self.whole else text


@dataclass(frozen=True)
class Range:
    """The values one key allows: numbers in any of ``intervals`` (NaN never), and ``None`` or +infinity
    where allowed. ``meaning`` says what the key does, or what a value outside the range would do.
    ``when`` (``("save_strategy", "steps")``) limits the check to runs with that setting."""

    intervals: tuple[Interval, ...]
    meaning: str
    none: bool = False
    inf: bool = False
    when: tuple[str, str] | None = None

    @property
    def allowed(self) -> str:
        """The allowed values as one phrase, e.g. ``>= 1 or None``."""
        return " or ".join(
            [*map(str, self.intervals), *(["None"] if self.none else []), *(["inf"] if self.inf else [])]
        )

    def allows(self, value: Any) -> bool:
        if value is None:
            return self.none
        if _is_number(value) and value == math.inf:
            return self.inf
        return any(value in interval for interval in self.intervals)

    def applies(self, settings: Any) -> bool:
        if self.when is None:
            return True
        key, wanted = self.when
        value = getattr(settings, key)
        return str(getattr(value, "value", value)) == wanted

    def message(self, key: str, value: Any) -> str:
        """The one line refusing ``value`` for ``key``."""
        where = f" with {self.when[0]}: {self.when[1]}" if self.when else ""
        return f"{key} must be {self.allowed}{where}, got {value!r} ({self.meaning})"


def at_least(low: float, meaning: str, **options: Any) -> Range:
    return Range((Interval(low),), meaning, **options)


def above(low: float, meaning: str, **options: Any) -> Range:
    return Range((Interval(low, low_open=True),), meaning, **options)


def between(
    low: float, high: float, meaning: str, *, low_open: bool = False, high_open: bool = False, **options: Any
) -> Range:
    return Range((Interval(low, high, low_open=low_open, high_open=high_open),), meaning, **options)


def any_number(meaning: str, **options: Any) -> Range:
    return Range((Interval(),), meaning, **options)


def steps_or_fraction(meaning: str, *, when: tuple[str, str]) -> Range:
    """A whole number of iterations >= 1, or a fraction of the run in (0, 1) (TrainingArguments' convention)."""
    return Range((Interval(1, whole=True), Interval(0, 1, low_open=True, high_open=True)), meaning, when=when)


class SettingField(dataclasses.Field):
    """A dataclass field that also holds its :class:`Range` (``range``), or why it has none (``unranged``).
    The range lives on the field, not in its ``metadata``: transformers' argument parser hands every
    metadata entry to argparse."""

    range: Range | None
    unranged: str | None


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    range: Range | None = None,
    *,
    default_factory: Any = dataclasses.MISSING,
    unranged: str | None = None,
) -> Any:
    """A dataclass field with its help text and, for a number, its :class:`Range` (or, in ``unranged``,
    why it has none)."""
    plain = dataclasses.field(default=default, default_factory=default_factory, metadata={"help": help})
    spec = SettingField.__new__(SettingField)
    for slot in dataclasses.Field.__slots__:  # the same field, whatever slots this Python's Field has
        setattr(spec, slot, getattr(plain, slot))
    spec.range, spec.unranged = range, unranged
    return spec


def range_of(settings_class: type, key: str) -> Range:
    """The :class:`Range` the field ``key`` of ``settings_class`` declares."""
    spec = next(f for f in dataclasses.fields(settings_class) if f.name == key)
    rule = getattr(spec, "range", None)
    if rule is None:
        raise KeyError(f"{settings_class.__name__}.{key} declares no range")
    return rule


def annotation_text(annotation: Any) -> str:
    """A field's annotation as text without spaces (``"bool|None"``, ``"Optional[bool]"``), whether as written or as
    transformers' argument parser leaves it after it resolved the fields' types (``bool``, ``bool | None``)."""
    if not isinstance(annotation, str):
        annotation = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return annotation.replace(" ", "").replace("typing.", "")


_FLAG = {"bool": "true or false", "bool|None": "true, false or None", "None|bool": "true, false or None"}


def _flag_allows(annotation: Any) -> str | None:
    """What a flag annotated ``annotation`` allows (a flag has no range), None for any other annotation."""
    written = annotation_text(annotation)
    return _FLAG.get("bool|None" if written == "Optional[bool]" else written)


def check_ranges(settings: Any) -> None:
    """Raise ValueError with :meth:`Range.message` for the first field of ``settings`` outside its range, or for a
    flag declared with :func:`setting` whose value is not a bool (parsers type a flag; a mapping or the Python API
    may not, and ``"false"`` is true)."""
    for spec in dataclasses.fields(settings):
        rule = getattr(spec, "range", None)
        if rule is not None and rule.applies(settings) and not rule.allows(value := getattr(settings, spec.name)):
            raise ValueError(rule.message(spec.name, value))
        allowed = _flag_allows(spec.type) if isinstance(spec, SettingField) else None
        if allowed and _not_a_flag_value(value := getattr(settings, spec.name), "None" in allowed):
            raise ValueError(f"{spec.name} must be {allowed}, got {value!r}")


def _not_a_flag_value(value: Any, none_allowed: bool) -> bool:
    return not (isinstance(value, bool) or (value is None and none_allowed))
