"""LightningCLI usage errors in a few lines: ``LightningCLI(..., parser_class=CompactArgumentParser)``, or
``class CLI(CompactCLI, LightningCLI)`` on every supported Lightning version.

A bad value in a LightningCLI configuration is a usage error (exit code 2) that jsonargparse prints as the
usage synopsis of every option (about 50 lines for a Trainer) followed by the explanation of every
alternative of every nested Union (about 25 more); the key that failed is in there, deep. A parser of this
class prints the innermost failing key with its whole path, the value given, what is allowed and a tip to
``--help`` instead, then exits 2 as before::

    error: trainer.callbacks[0] (lightning_debug.MemoryProfilerCallback).memory_high_fraction: invalid value
      given: 1.5
      allowed: a number in (0, 1]
    tip: for the accepted options run: train.py fit --help (this class: ... --trainer.callbacks.help ...)

``parser_class`` is LightningCLI's own argument for the class of every parser it builds (subcommand parsers
included), so this works for any ``LightningCLI`` subclass, with subcommands or ``run=False``; nothing of
jsonargparse is patched. ``parser_class`` arrived in Lightning 2.5.1; :class:`CompactCLI` gives the same parsers
through ``LightningCLI.init_parser``, the method every Lightning release builds each parser with, so it serves
2.2 to 2.5.0 too. A project with its own parser class mixes :class:`CompactErrors` in first. Only
what is printed changes: the full message still goes to the parser's logger, ``exit_on_error=False`` still
raises it, and ``JSONARGPARSE_DEBUG=true`` still raises it with its whole explanation.

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
    """Mix into a jsonargparse ``ArgumentParser`` class (first) to print its usage errors in a few lines.

    jsonargparse's own ``error`` runs unchanged (logging, ``exit_on_error``, debug mode); only what it
    writes to stderr before exiting is replaced by the short form.
    """

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
    """Lightning's parser with :class:`CompactErrors`: give it to ``LightningCLI(parser_class=...)``, from
    ``lightning.pytorch.cli`` or ``pytorch_lightning.cli``."""

    def add_lightning_class_args(self, lightning_class: Any, nested_key: str, subclass_mode: bool = False,
                                 required: bool = True) -> list[str]:
        """Lightning's own, from the package of ``lightning_class``: ``lightning``'s parser refuses the ``Trainer``
        that ``pytorch_lightning.cli.LightningCLI`` gives it (and the other way round); the two differ only there."""
        parser: Any = LightningArgumentParser
        if framework_of(lightning_class) == STANDALONE:
            parser = importlib.import_module(standalone_path("lightning.pytorch.cli")).LightningArgumentParser
        return parser.add_lightning_class_args(self, lightning_class, nested_key, subclass_mode, required)


class CompactCLI:
    """Mix into a ``LightningCLI`` class (first) to give every parser it builds :class:`CompactErrors`.

    ``init_parser`` is the public method through which every ``LightningCLI`` release builds its main and
    subcommand parsers; the parser it returns (with its ``--config`` option and every argument added later) is
    kept and only its class changes, to one that adds :class:`CompactErrors`'s methods: Lightning's parser
    becomes a :class:`CompactArgumentParser`, any other (``pytorch_lightning``'s, a project's own) a subclass
    of its class. A parser that already has compact errors (from ``parser_class=``) is kept as it is.
    """

    def init_parser(self, **kwargs: Any) -> Any:
        parser = super().init_parser(**kwargs)  # type: ignore[misc]
        if not isinstance(parser, CompactErrors):
            parser.__class__ = compact_class(type(parser))
        return parser


@functools.cache
def compact_class(parser_class: type) -> type:
    """``parser_class`` with :class:`CompactErrors` mixed in first (:class:`CompactArgumentParser` for Lightning's).

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
