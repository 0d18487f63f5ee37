"""A jsonargparse usage error in a few lines: the innermost key that failed, the value, what is allowed.

jsonargparse explains a value that fits no type of a Union with every alternative, nested once per level (about
25 lines for one bad number). :func:`shorten` follows the deepest alternative, the one that got furthest, down by
indentation to the key that failed; a message it does not recognise keeps its first lines. jsonargparse's error
holds only this English text, so ``tests/unit/test_cli_errors.py`` pins each pattern to a real message.

Example::

    >>> message = '''Parser key "trainer.callbacks":
    ...   Does not validate against any of the Union subtypes
    ...   Errors:
    ...     - Problem with given class_path 'lightning_debug.MemoryProfilerCallback':
    ...         Parser key "memory_high_fraction":
    ...           Does not validate against any of the Union subtypes
    ...           Errors:
    ...             - Not of type UnitFraction: does not conform to restriction v>0 and v<=1
    ...             - Expected a <class 'NoneType'>
    ...           Given value: 1.5
    ...     - Expected a <class 'NoneType'>
    ...   Given value: [{'class_path': 'lightning_debug.MemoryProfilerCallback'}]'''
    >>> print("\\n".join(shorten(message).lines()))
    trainer.callbacks[0] (lightning_debug.MemoryProfilerCallback).memory_high_fraction: invalid value
      given: 1.5
      allowed: a number in (0, 1]
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from lightning_debug.config_types import ALLOWED

MAX_LINES = 6
"""Lines kept of a message that is not a key's explanation (with the tip, under 10 in all)."""
MAX_WIDTH = 200
"""Characters kept of one line (a given value can be a whole list of callbacks)."""

_KEY = re.compile(r'^Parser key "(?P<key>.+)":$')
_CLASS = re.compile(r"^Problem with given class_path '(?P<cls>.+)':$")
_NOT_ACCEPTED = re.compile(r"^Option '(?P<key>.+)' is not accepted$")
_GROUP_OPTION = re.compile(r"^(?P<kind>Group|Subcommand) '(?P<group>.+)' does not accept option '(?P<key>.+)'$")
_NOT_OF_TYPE = re.compile(r"^Not of type (?P<type>\w+): (?:(?P<value>.*?) )?(?P<why>does not .*|not an? .*)$")
_ENUM = re.compile(r"^Expected a member of <enum '(?P<enum>\w+)'>: \{(?P<names>[^}]*)\}(?:\. Got value: (?P<value>.*))?$")
_LITERAL = re.compile(r"^Expected a (?:typing\.)?Literal\[(?P<values>.*)\](?:\. Got value: (?P<value>.*))?$")
_IMPORT_PATH = re.compile(r"^Expected a dot import path string: (?P<value>.*)$")
_EXPECTED = re.compile(r"^Expected an? (?P<type>.+?)(?:\. Got value: (?P<value>.*))?$")
_CLASS_NAME = re.compile(r"^<class '(?:[\w.]+\.)?(?P<name>\w+)'>$")
_IRRELEVANT = ("Expected a <class 'NoneType'>", "Not a valid subclass of ")
_BUILTINS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "NoneType": "null",
             "dict": "a mapping", "list": "a list"}


@dataclass
class _Node:
    text: str
    raw: str = ""
    children: list[_Node] = field(default_factory=list)


@dataclass
class ShortError:
    """The failing key (``path``), the problem, the value given and what is allowed; ``key`` and ``class_path``
    (the outermost key and the first class) name the ``--help`` that lists its options."""

    path: str = ""
    problem: str = "invalid value"
    given: str | None = None
    allowed: str | None = None
    key: str | None = None
    class_path: str | None = None
    generic: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The error as lines, without the ``error:`` word and the tip."""
        if not self.path:
            return [_cut(line) for line in self.generic[:MAX_LINES]]
        found = [_cut(f"{self.path}: {self.problem}")]
        if self.given is not None:
            found.append(_cut(f"  given: {self.given}"))
        if self.allowed:
            found.append(_cut(f"  allowed: {self.allowed}"))
        return found


def shorten(message: str) -> ShortError:
    """The innermost failing key of a jsonargparse error ``message``, or its first lines when it names none."""
    nodes = _tree(message)
    segments: list[tuple[str, str, str | None]] = []
    leaves, given, subtypes = _descend(nodes, segments)
    if not segments:
        single = _GROUP_OPTION.match(message.strip())
        if single:
            path = single["key"] if single["kind"] == "Subcommand" else f"{single['group']}.{single['key']}"
            return ShortError(path=path, problem="no such option")
        return ShortError(generic=[line.rstrip() for line in message.strip().splitlines()])
    short = ShortError(problem="", given=given)
    for leaf in leaves:
        unknown = _NOT_ACCEPTED.match(leaf)
        if unknown:
            segments.append(("key", unknown["key"], None))
            short.problem = "no such option"
    allowed, value, problems = _allowed(leaves)
    short.allowed = _describe_tuple(subtypes) or allowed
    if short.given is None:
        short.given = value
    short.path = _path(segments, short.given)
    short.key = next((name for kind, name, _ in segments if kind == "key"), None)
    short.class_path = next((name for kind, name, _ in segments if kind == "class"), None)
    if short.given is not None and (short.given != short.given.strip() or not short.given):
        short.given = repr(short.given)
    short.problem = short.problem or "; ".join(problems) or "invalid value"
    return short


def _tree(message: str) -> list[_Node]:
    """The message's lines as a tree by indentation; a ``- `` item's deeper lines are its children."""
    root = _Node("")
    stack: list[tuple[int, _Node]] = [(-1, root)]
    for raw in message.splitlines():
        text = raw.strip()
        if not text:
            continue
        indent = len(raw) - len(raw.lstrip(" "))
        while stack[-1][0] >= indent:
            stack.pop()
        node = _Node(text[2:] if text.startswith("- ") else text, raw.lstrip(" "))
        stack[-1][1].children.append(node)
        stack.append((indent, node))
    return root.children


def _descend(nodes: list[_Node], segments: list[tuple[str, str, str | None]], given: str | None = None
             ) -> tuple[list[str], str | None, str | None]:
    """The innermost leaves of the deepest alternative, the value given to their key and its subtypes."""
    given = next((node.raw[len("Given value: "):] for node in nodes if node.text.startswith("Given value:")), given)
    for node in nodes:
        key, cls = _KEY.match(node.text), _CLASS.match(node.text)
        if key or cls:
            segments.append(("key", key["key"], given) if key else ("class", cls["cls"], given))
            return _descend(node.children, segments)
    subtypes = next((node.text for node in nodes if node.text.startswith("Subtypes:")), None)
    errors = next((node for node in nodes if node.text == "Errors:"), None)
    if errors is None:
        leaves = [node.text for node in nodes if not node.text.startswith(
            ("Given value", "Subtypes:", "Does not validate"))]
        return leaves, given, subtypes
    relevant = [node for node in errors.children if not node.text.startswith(_IRRELEVANT)] or errors.children
    deeper = [node for node in relevant if _KEY.match(node.text) or _CLASS.match(node.text)]
    if deeper:
        return _descend(deeper[:1], segments, given)
    return [node.text for node in relevant], given, subtypes


def _path(segments: list[tuple[str, str, str | None]], innermost: str | None) -> str:
    """``a.b[0] (pkg.Class).c``: a class the user named is shown, with its position in a given list when one
    item names it (told apart by the next key and the ``innermost`` value when several do)."""
    path = ""
    for position, (kind, name, given) in enumerate(segments):
        if kind == "key":
            path += ("." if path else "") + name
            continue
        following = next((n for k, n, _ in segments[position + 1:] if k == "key"), None)
        index = _index_in(given, name, following, innermost)
        if index is not None:
            path += f"[{index}]"
        if given is None or name in given:
            path += f" ({name})"
    return path


def _index_in(given: str | None, class_path: str, key: str | None, value: str | None) -> int | None:
    items = _list_items(given) if given else None
    if not items:
        return None
    if len(items) == 1:
        return 0
    naming = [i for i, item in enumerate(items) if re.search(rf"['\"]{re.escape(class_path)}['\"]", item)]
    if len(naming) > 1 and key:
        naming = [i for i in naming if re.search(rf"\b{re.escape(key)}\b", items[i])]
    if len(naming) > 1 and value:
        naming = [i for i in naming if value in items[i]]
    return naming[0] if len(naming) == 1 else None


def _list_items(text: str) -> list[str] | None:
    """The top-level items of a list's repr, None if it is not one."""
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return None
    items, depth, quote, start = [], 0, "", 1
    for position, char in enumerate(text[1:-1], start=1):
        if quote:
            quote = "" if char == quote and text[position - 1] != "\\" else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:position])
            start = position + 1
    items.append(text[start:-1])
    return [item.strip() for item in items if item.strip()]


def _allowed(leaves: list[str]) -> tuple[str | None, str | None, list[str]]:
    """What the leaves allow (in words), the value they quote, and the leaves that are not about a type."""
    names: list[str] = []
    kinds: list[str] = []
    problems: list[str] = []
    value: str | None = None
    for leaf in sorted(leaves, key=lambda text: not _LITERAL.match(text)):  # a Literal's spelling first
        literal, enum, typed = _LITERAL.match(leaf), _ENUM.match(leaf), _NOT_OF_TYPE.match(leaf)
        import_path = _IMPORT_PATH.match(leaf)
        expected = import_path or _EXPECTED.match(leaf)
        if import_path:
            kinds.append("an importable class path (package.module.Class)")
        elif literal:
            names += [str(item) for item in _literal_values(literal["values"])]
        elif enum:
            names += [name.strip() for name in enum["names"].split(",") if name.strip()]
        elif typed:
            kinds.append(ALLOWED.get(typed["type"]) or f"{typed['type']} ({typed['why']})")
        elif expected:
            kinds.append(_type_words(expected["type"]))
        elif not _NOT_ACCEPTED.match(leaf):
            problems.append(leaf)
        found = literal or enum or typed or expected
        if found and found["value"] and value is None:
            value = found["value"]
    unique = list({name.lower(): name for name in reversed(names)}.values())[::-1]
    if unique:
        kinds.insert(0, "one of " + ", ".join(unique))
    return " or ".join(dict.fromkeys(kinds)) or None, value, problems


def _literal_values(text: str) -> list[object]:
    try:
        return list(ast.literal_eval(f"[{text}]"))
    except (ValueError, SyntaxError):
        return [part.strip().strip("'\"") for part in text.split(",")]


def _type_words(text: str) -> str:
    """``<class 'int'>`` -> "an integer"; one of our constrained types -> its words; else the type."""
    text = text.strip()
    name = _CLASS_NAME.match(text)
    short = name["name"] if name else text.rpartition(".")[2] if re.fullmatch(r"[\w.]+", text) else text
    article = "an" if short[:1].lower() in "aeiou" else "a"
    return ALLOWED.get(short) or _BUILTINS.get(short) or (f"{article} {short}" if name else text)


def _describe_tuple(subtypes: str | None) -> str | None:
    """``[a, b]`` in words for a tuple-typed key (``profile_steps``), whose leaf names one item only."""
    match = re.search(r"tuple\[(?P<items>[^\[\]]+)\]", subtypes or "")
    if not match:
        return None
    return "[" + ", ".join(_type_words(item) for item in match["items"].split(",")) + "]"


def _cut(line: str) -> str:
    return line if len(line) <= MAX_WIDTH else line[:MAX_WIDTH - 4] + " ..."
