"""Parameters that never had a gradient, looked at on every optimizer step until they get one or are
confirmed missing (see :mod:`.missing`): ``.grad is None`` is a Python attribute, so watching costs no
device work and no sync, and only the few candidate parameters are looked at.

Example::

    >>> import torch
    >>> used, unused = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    >>> used.grad = torch.ones(1)
    >>> watch = CandidateWatch()
    >>> watch.replace(None, ["unused"], ["used"], ["used", "unused"], [used, unused])
    >>> watch.look(None)
    ([], ['unused'])
    >>> used.grad = None; watch.look(None) is None  # no backward ran on this step: nothing to learn
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch


class CandidateWatch:
    """The watched parameters of each optimizer, and per optimizer the parameters that had a gradient on the
    check step (``anchors``): all of them without a ``.grad`` says no backward ran, as on a step whose
    ``training_step`` returned None. Any one of them could be conditional itself (a task's head), so one is
    not enough; the first that has a gradient ends the look, which is the first one on most steps."""

    def __init__(self) -> None:
        self.watched: list[tuple[str, torch.Tensor, Any]] = []
        self.anchors: dict[Any, list[torch.Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self.watched)

    def replace(self, optimizer: Any, names: Sequence[str], anchors: Sequence[str], index_names: Sequence[str],
                params: Sequence[torch.Tensor]) -> None:
        """Watch ``names`` on ``optimizer``'s steps from now on (instead of what was watched for it), with
        ``anchors`` (the parameters that had a gradient); ``index_names`` and ``params`` say which tensor is
        which."""
        self.watched = [entry for entry in self.watched if entry[2] != optimizer]
        if not names:
            return
        position = {name: i for i, name in enumerate(index_names)}
        self.watched += [(name, params[position[name]], optimizer) for name in names if name in position]
        self.anchors[optimizer] = [params[position[name]] for name in anchors if name in position]

    def look(self, optimizer: Any) -> tuple[list[str], list[str]] | None:
        """The watched parameters of ``optimizer`` with and without a gradient now (None: nothing to look at,
        or no backward ran)."""
        mine = [(name, param) for name, param, owner in self.watched if owner == optimizer]
        anchors = self.anchors.get(optimizer)
        if not mine or (anchors and all(param.grad is None for param in anchors)):
            return None
        return ([name for name, param in mine if param.grad is not None],
                [name for name, param in mine if param.grad is None])

    def drop(self, names: Iterable[str]) -> None:
        done = set(names)
        if done:
            self.watched = [entry for entry in self.watched if entry[0] not in done]

    def clear(self) -> None:
        self.watched, self.anchors = [], {}
