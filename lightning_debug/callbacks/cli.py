"""LightningCLI usage errors in a few lines: ``LightningCLI(..., parser_class=CompactArgumentParser)``, or
``class CLI(CompactCLI, LightningCLI)`` on every supported Lightning version.

jsonargparse prints a bad value as the synopsis of every option (about 50 lines for a Trainer) and every
alternative of every nested Union (about 25 more), the failing key deep inside. These parsers print the
innermost failing key with its path, the value given, what is allowed and a tip, then exit 2 as before::

    error: trainer.callbacks[0] (lightning_debug.MemoryProfilerCallback).memory_high_fraction: invalid value
      given: 1.5
      allowed: a number in (0, 1]
    tip: for the accepted options run: train.py fit --help (this class: ... --trainer.callbacks.help ...)

``parser_class`` (Lightning 2.5.1+) sets the class of every parser LightningCLI builds; nothing of jsonargparse
is patched. :class:`CompactCLI` does the same through ``init_parser``, which every release has (2.2 to 2.5.0
too). A project with its own parser class mixes :class:`CompactErrors` in first. Only what is printed changes:
the logger, ``exit_on_error=False`` and ``JSONARGPARSE_DEBUG=true`` get the full message as before.

Example::

    >>> from lightning.pytorch.cli import LightningCLI
    >>> issubclass(CompactArgumentParser, CompactErrors)
    True
    >>> # LightningCLI(MyModel, parser_class=CompactArgumentParser)          # lightning >= 2.5.1
    >>> class CLI(CompactCLI, LightningCLI): ...                                # every supported version
    >>> # CLI(MyModel)
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import sys
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser

from lightning_debug.callbacks.base import DebugCallback
from lightning_debug.callbacks.cli_errors import shorten
from lightning_debug.callbacks.frameworks import STANDALONE, framework_of, standalone_path
from lightning_debug.callbacks.cli_usage import register
from lightning_debug.config import DebugConfig

register(DebugCallback, DebugConfig)  # in case a callback was imported before jsonargparse


class CompactErrors:
    """Mix into a jsonargparse ``ArgumentParser`` class (first): its ``error`` runs, with a few lines on stderr."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        written = io.StringIO()
        try:
            with contextlib.redirect_stderr(written):
                super().error(message, ex)  # type: ignore[misc]
        except SystemExit:
            parser = getattr(ex, "subcommand_parser", None) or self
            sys.stderr.write("".join(f"{line}\n" for line in compact_error(parser, message)))
            raise
        raise AssertionError("ArgumentParser.error returned")  # pragma: no cover


class CompactArgumentParser(CompactErrors, LightningArgumentParser):
    """Lightning's parser with :class:`CompactErrors`, for ``LightningCLI(parser_class=...)`` of either package."""

    def add_lightning_class_args(self, lightning_class: Any, nested_key: str, subclass_mode: bool = False,
                                 required: bool = True) -> list[str]:
        """Lightning's own, from ``lightning_class``'s package (each package's parser refuses the other's Trainer)."""
        parser: Any = LightningArgumentParser
        if framework_of(lightning_class) == STANDALONE:
            parser = importlib.import_module(standalone_path("lightning.pytorch.cli")).LightningArgumentParser
        return parser.add_lightning_class_args(self, lightning_class, nested_key, subclass_mode, required)


class CompactCLI:
    """Mix into a ``LightningCLI`` class (first): every parser it builds gets :class:`CompactErrors`."""

    def init_parser(self, **kwargs: Any) -> Any:
        parser = super().init_parser(**kwargs)  # type: ignore[misc]
        if not isinstance(parser, CompactErrors):
            parser.__class__ = compact_class(type(parser))
        return parser


@functools.cache
def compact_class(parser_class: type) -> type:
    """``parser_class`` with :class:`CompactErrors` mixed in first.

    Example::

        >>> compact_class(LightningArgumentParser) is CompactArgumentParser
        True
    """
    if parser_class is LightningArgumentParser:
        return CompactArgumentParser
    return type(f"Compact{parser_class.__name__}", (CompactErrors, parser_class), {"__module__": __name__})


def compact_error(parser: Any, message: str) -> list[str]:
    """The lines printed for ``message``: the error, at most six lines of it, and one tip to ``--help``."""
    short = shorten(message)
    body = short.lines() or [message.strip()[:200]]
    prog = str(getattr(parser, "prog", "")).replace(" [options]", "")
    tip = f"tip: for the accepted options run: {prog} --help"
    options = getattr(parser, "_option_string_actions", {})
    if short.class_path and short.key and f"--{short.key}.help" in options:
        tip += f" (this class's: {prog} --{short.key}.help {short.class_path})"
    return [f"error: {body[0]}", *body[1:], tip]
