"""Monitoring never breaks training: a failing check becomes one warning and the run goes on."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from lightning_debug.errors import AnomalyError

CallableT = TypeVar("CallableT", bound=Callable[..., Any])


class CheckFailures:
    """Remembers which checks already failed, so each warns once; ``AnomalyError`` passes through."""

    def __init__(self) -> None:
        self.failed: set[str] = set()

    def call(self, name: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except AnomalyError:
            raise
        except Exception as failure:
            if name not in self.failed:
                self.failed.add(name)
                warnings.warn(f"lightning-debug: {name} failed ({type(failure).__name__}: {failure}); this check "
                              "is skipped, training continues.", RuntimeWarning, stacklevel=4)
            return None


def guarded(method: CallableT) -> CallableT:
    """Run a hook or method through its owner's :class:`CheckFailures` (created on first use)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        failures = self.__dict__.get("_check_failures")
        if failures is None:
            failures = self.__dict__["_check_failures"] = CheckFailures()
        return failures.call(f"{type(self).__name__}.{method.__name__}", method, self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
