"""Randomness where an evaluation should have none: dropout that still drops, BatchNorm that still updates its
running statistics, while the model is evaluated.

``F.dropout(x, 0.5)`` defaults to ``training=True``, and ``F.dropout(x, p, training=True)`` written once for
training stays on whatever mode the model is in; a Dropout or BatchNorm submodule switched back to ``.train()``
inside ``forward`` does the same. No module is in the wrong mode that a walk of the tree could see, so the calls
themselves are watched: :class:`RandomInEvaluation`, a ``TorchFunctionMode`` entered for one evaluation batch, notes
each dropout call with ``training=True`` and ``p > 0`` and each ``batch_norm`` call that updates running statistics,
with the user's source line. It only looks at the functions' arguments (no tensor is read).

Example::

    >>> import torch
    >>> from torch.nn import functional as F
    >>> with RandomInEvaluation() as watch:
    ...     _ = F.dropout(torch.ones(4), 0.5)          # training=True by default
    ...     _ = F.dropout(torch.ones(4), 0.5, training=False)
    >>> [(call.operation, call.count) for call in watch.calls.values()]
    [('torch.nn.functional.dropout', 1)]
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from lightning_debug.checks.localize import operation_name, user_source

DROPOUTS = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
                      torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout})
"""The dropout functions: ``p`` is their second argument and ``training`` (``train``) their third, True by default
in the functional forms and required in the ``torch.*`` ones."""


@dataclass
class RandomCall:
    """One place that drew randomness during evaluation: the operation, where the user called it, how often."""

    operation: str
    source: dict[str, Any] | None
    count: int = 1

    def where(self) -> str:
        if self.source is None:
            return self.operation
        return f"{self.operation} at {self.source['file']}:{self.source['line']} (`{self.source['code']}`)"


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, names: tuple[str, ...],
              default: Any) -> Any:
    if len(args) > position:
        return args[position]
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return default


def draws_randomness(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call drops units or updates running statistics as in training.

    Example::

        >>> x = torch.ones(2, 3)
        >>> draws_randomness(F.dropout, (x, 0.1), {}), draws_randomness(F.dropout, (x,), {"p": 0.0})
        (True, False)
        >>> stats = torch.zeros(3), torch.ones(3)
        >>> [draws_randomness(F.batch_norm, (x, *stats), kwargs) for kwargs in ({"training": True}, {})]
        [True, False]
    """
    if func in DROPOUTS:
        p = _argument(args, kwargs, 1, ("p",), 0.5)
        return bool(_argument(args, kwargs, 2, ("training", "train"), True)) and isinstance(p, (int, float)) and p > 0
    if func is F.batch_norm:
        running = _argument(args, kwargs, 1, ("running_mean",), None)
        return running is not None and bool(_argument(args, kwargs, 5, ("training",), False))
    return False


class RandomInEvaluation(TorchFunctionMode):
    """Notes every call that draws randomness as in training while active (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[tuple[str, str, int], RandomCall] = {}

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if draws_randomness(func, args, kwargs):
            source = user_source(traceback.extract_stack()[:-1])
            key = (operation_name(func), *((source["file"], source["line"]) if source else ("", 0)))
            if key in self.calls:
                self.calls[key].count += 1
            else:
                self.calls[key] = RandomCall(key[0], source)
        return func(*args, **kwargs)


__all__ = ["RandomCall", "RandomInEvaluation", "draws_randomness"]
