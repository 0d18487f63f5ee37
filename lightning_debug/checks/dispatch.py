"""Torch's dispatch-mode hook and pytree flattening, which torch keeps in private modules, behind import probes.

Where a torch lacks the mode, :class:`TorchDispatchMode` is a stand-in whose ``__enter__`` raises: the replay
fails once through the failure policy and the checks that do not replay still run.

>>> import torch
>>> tree_leaves(([torch.ones(1)], {"a": 2}))[1]
2
>>> HAS_DISPATCH_MODE
True
"""

from __future__ import annotations

from typing import Any

__all__ = ["HAS_DISPATCH_MODE", "TorchDispatchMode", "tree_leaves"]

try:
    from torch.utils._python_dispatch import TorchDispatchMode
    HAS_DISPATCH_MODE = True
except ImportError:  # pragma: no cover - every torch 2.x has it
    HAS_DISPATCH_MODE = False

    class TorchDispatchMode:  # type: ignore[no-redef]
        """Stands in for torch's mode: entering it says why the replay cannot run on this torch."""

        def __enter__(self) -> Any:
            raise RuntimeError("this torch has no torch.utils._python_dispatch.TorchDispatchMode: the replay that "
                               "names the kernel is off (upgrade torch)")

        def __exit__(self, *exc: Any) -> None:
            return None

try:
    from torch.utils._pytree import tree_leaves
except ImportError:  # pragma: no cover
    def tree_leaves(tree: Any) -> list[Any]:  # type: ignore[misc]
        """The leaves of nested lists, tuples and dicts, in order."""
        if isinstance(tree, (list, tuple)):
            return [leaf for item in tree for leaf in tree_leaves(item)]
        if isinstance(tree, dict):
            return [leaf for item in tree.values() for leaf in tree_leaves(item)]
        return [tree]
