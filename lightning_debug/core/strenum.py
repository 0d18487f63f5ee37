"""A string enum that reads as its value everywhere, on every supported Python.

``enum.StrEnum`` is Python 3.11+; the package supports 3.10. On 3.10 a plain ``(str, enum.Enum)``
member prints as ``Class.NAME`` and formats as its value, on 3.11+ it does both as ``Class.NAME``.
:class:`StrEnum` pins ``str()`` and ``format()`` to the value on all of them, as ``enum.StrEnum``
does, so events.jsonl, report text and f-strings stay the same whatever Python runs the training.

Example::

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
