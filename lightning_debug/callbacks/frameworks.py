"""Lightning's two import names: ``lightning.pytorch`` (the default) and the standalone ``pytorch_lightning``.

Each has its own ``Callback``, ``Trainer``, loggers and bars, and an ``isinstance`` check against one fails for the
other's objects (a ``pytorch_lightning.Trainer`` refuses a foreign ``Callback``): the callbacks derive from the
``Callback`` of each installed package (:data:`CALLBACK_BASES`), loggers and bars are checked against both
(:func:`classes`). ``pytorch_lightning`` is imported only where it is installed.

Example::

    >>> import lightning.pytorch as pl
    >>> from lightning.pytorch.loggers import TensorBoardLogger
    >>> issubclass(TensorBoardLogger, classes("lightning.fabric.loggers", "TensorBoardLogger"))
    True
    >>> framework_of(pl.Trainer(logger=False, enable_progress_bar=False))
    'lightning'
    >>> standalone_path("lightning.pytorch.loggers"), standalone_path("lightning.fabric.loggers")
    ('pytorch_lightning.loggers', 'lightning_fabric.loggers')
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from importlib import metadata
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_debug.core.guard import describe

STANDALONE = "pytorch_lightning"
STANDALONE_DISTRIBUTION = "pytorch-lightning"
STANDALONE_FLOOR = (2, 2)  # the same floor as ``lightning``: the two are released together
STANDALONE_NAMES = {"lightning.pytorch": STANDALONE, "lightning.fabric": "lightning_fabric"}


def unserved_reason(version: str) -> str | None:
    """Why ``pytorch_lightning`` ``version`` cannot run the callbacks, with what to install; None when it can.

    Example::

        >>> unserved_reason("2.4.0") is None, unserved_reason("2.10.0rc1") is None
        (True, True)
        >>> print(unserved_reason("1.9.5"))
        lightning-debug needs pytorch_lightning 2.2 or later, and this trainer is pytorch_lightning 1.9.5: pip install -U "pytorch-lightning>=2.2" (or build the trainer from lightning.pytorch: pip install -U lightning)
    """
    numbers = re.match(r"(\d+)\.(\d+)", version)
    if numbers is None or (int(numbers[1]), int(numbers[2])) >= STANDALONE_FLOOR:
        return None
    floor = ".".join(map(str, STANDALONE_FLOOR))
    return (f"lightning-debug needs {STANDALONE} {floor} or later, and this trainer is {STANDALONE} {version}: "
            f'pip install -U "{STANDALONE_DISTRIBUTION}>={floor}" (or build the trainer from lightning.pytorch: '
            "pip install -U lightning)")


def _standalone_callback() -> tuple[type | None, str | None]:
    """``pytorch_lightning.Callback`` where it is installed and imports, and why it cannot serve (None when it can)."""
    if importlib.util.find_spec(STANDALONE) is None:
        return None, None
    try:
        module = importlib.import_module(f"{STANDALONE}.callbacks")
    except Exception as error:  # a broken install must not take lightning users down with it
        return None, f"{STANDALONE} is installed but does not import ({describe(error)})"
    try:
        version = metadata.version(STANDALONE_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        version = str(getattr(importlib.import_module(STANDALONE), "__version__", "0"))
    callback = getattr(module, "Callback", None)
    return (callback if isinstance(callback, type) else None), unserved_reason(version)


STANDALONE_CALLBACK, STANDALONE_PROBLEM = _standalone_callback()
CALLBACK_BASES: tuple[type, ...] = (Callback,) if STANDALONE_CALLBACK is None else (Callback, STANDALONE_CALLBACK)
"""``lightning``'s ``Callback`` first (its methods are the ones found), and ``pytorch_lightning``'s where installed."""


def standalone_path(path: str) -> str:
    """The standalone packages' module that mirrors ``path`` (under ``lightning.pytorch`` or ``lightning.fabric``)."""
    for prefix, name in STANDALONE_NAMES.items():
        if path == prefix or path.startswith(prefix + "."):
            return name + path[len(prefix):]
    raise ValueError(f"{path} is not under lightning.pytorch or lightning.fabric")


@functools.cache
def classes(path: str, name: str) -> tuple[type, ...]:
    """The class ``name`` of module ``path`` and, where ``pytorch_lightning`` is in use, of its standalone mirror."""
    found = [getattr(importlib.import_module(path), name)]
    if STANDALONE_CALLBACK is not None:
        try:
            found.append(getattr(importlib.import_module(standalone_path(path)), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def framework_of(obj: Any) -> str:
    """``"lightning"`` or ``"pytorch_lightning"``: the package of the first class in the hierarchy of ``obj`` (a class
    or an instance) from one of them (a user's ``Trainer`` subclass counts as its base's); ``"lightning"`` if none."""
    for cls in getattr(obj if isinstance(obj, type) else type(obj), "__mro__", ()):
        root = cls.__module__.partition(".")[0]
        if root in ("lightning", STANDALONE):
            return root
    return "lightning"


def check_trainer(trainer: Any) -> None:
    """Raise ``RuntimeError`` naming what to install when ``trainer`` is a ``pytorch_lightning`` one not served."""
    if STANDALONE_PROBLEM is not None and framework_of(trainer) == STANDALONE:
        raise RuntimeError(STANDALONE_PROBLEM)
