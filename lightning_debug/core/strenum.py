"""A string enum that reads as its value everywhere, on every supported Python.

``enum.StrEnum`` is Python 3.11+ and a plain ``(str, enum.Enum)`` formats differently on 3.10 and 3.11+; this pins
``str()`` and ``format()`` to the value, so events.jsonl and report text never change.
    >>> from lightning_debug.core.strenum import StrEnum
    >>> class Colour(StrEnum):
    ...     RED = "red"
    >>> str(Colour.RED), f"{Colour.RED}", f"{Colour.RED:>5}", Colour.RED == "red"
    ('red', 'red', '  red', True)
    >>> import json; json.dumps({Colour.RED: Colour.RED})
    '{"red": "red"}'
"""

from __future__ import annotations

import enum


class StrEnum(str, enum.Enum):
    """A member is a ``str`` equal to its value, and ``str()``/``format()`` give that value."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, format_spec: str) -> str:
        return str.__format__(str.__str__(self), format_spec)
