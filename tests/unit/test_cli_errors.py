"""A jsonargparse error in a few lines (callbacks/cli_errors.py), fed messages recorded from jsonargparse 4.53
through LightningCLI; tests/integration/test_cli_parse.py runs the real parser over every field."""

from __future__ import annotations

from lightning_debug.callbacks.cli_errors import MAX_LINES, MAX_WIDTH, shorten

NOT_A_CALLBACK = """    - Not a valid subclass of Callback
      Subclass types expect one of:
      - a class path (str)
      - a dict with class_path entry
    - Expected a <class 'NoneType'>"""

SECOND_CALLBACK_NESTED = f"""Parser key "trainer.callbacks":
  Does not validate against any of the Union subtypes
  Subtypes: [list[lightning.pytorch.callbacks.callback.Callback], <class 'lightning.pytorch.callbacks.callback.Callback'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'lightning_debug.PerformanceProfilerCallback':
        Parser key "config":
          Does not validate against any of the Union subtypes
          Subtypes: [<class 'lightning_debug.config.DebugConfig'>, <class 'NoneType'>]
          Errors:
            - Problem with given class_path 'lightning_debug.DebugConfig':
                Parser key "profile_steps":
                  Does not validate against any of the Union subtypes
                  Subtypes: [tuple[jsonargparse.typing.NonNegativeInt, jsonargparse.typing.ProfileLength], <class 'NoneType'>]
                  Errors:
                    - Not of type ProfileLength: 500 does not conform to restriction v>=0 and v<=50
                    - Expected a <class 'NoneType'>
                  Given value type: <class 'list'>
                  Given value: [2, 500]
            - Expected a <class 'NoneType'>
          Given value type: <class 'dict'>
          Given value: {{'profile_steps': [2, 500]}}
{NOT_A_CALLBACK}
  Given value type: <class 'list'>
  Given value: [Namespace(class_path='lightning_debug.PerformanceProfilerCallback', init_args=Namespace(config=None)), {{'class_path': 'lightning_debug.PerformanceProfilerCallback', 'init_args': {{'config': {{'profile_steps': [2, 500]}}}}}}]"""


def test_the_innermost_key_has_its_whole_path_and_the_implicit_class_is_left_out() -> None:
    short = shorten(SECOND_CALLBACK_NESTED)
    assert short.lines() == [
        "trainer.callbacks[1] (lightning_debug.PerformanceProfilerCallback).config.profile_steps: invalid value",
        "  given: [2, 500]",
        "  allowed: [an integer >= 0, an integer in [0, 50]]",
    ]
    assert (short.key, short.class_path) == ("trainer.callbacks", "lightning_debug.PerformanceProfilerCallback")


def test_an_enum_and_its_literal_are_one_list_of_names_and_a_value_without_union_comes_from_the_leaf() -> None:
    message = f"""Parser key "trainer.callbacks":
  Errors:
    - Problem with given class_path 'lightning_debug.AnomalyDetectionCallback':
        Parser key "anomaly_detection_mode":
          Errors:
            - Expected a member of <enum 'AnomalyMode'>: {{WARN,RAISE,SKIP,STOP}}
            - Expected a typing.Literal['warn', 'raise', 'skip', 'stop']
            - Expected a <class 'NoneType'>
          Given value: explode
{NOT_A_CALLBACK}"""
    assert shorten(message).lines()[1:] == ["  given: explode", "  allowed: one of warn, raise, skip, stop"]
    nested = """Parser key "save_plots":
  Expected a <class 'bool'>. Got value: maybe"""
    assert shorten(nested).lines() == ["save_plots: invalid value", "  given: maybe", "  allowed: true or false"]


def test_a_blank_string_is_shown_quoted() -> None:
    message = """Parser key "debug_output_dir":
  Errors:
    - Not of type NotEmptyStr: does not match regular expression ^.*[^ ].*$
    - Expected a <class 'NoneType'>
  Given value:  """
    assert shorten(message).lines()[1:] == ["  given: ' '", "  allowed: a string that is not blank"]


def test_an_unknown_option_names_its_key() -> None:
    assert shorten("Group 'trainer' does not accept option 'max_stepz'").lines() == [
        "trainer.max_stepz: no such option"]
    assert shorten("Subcommand 'fit' does not accept option 'trainer.max_stepz'").lines() == [
        "trainer.max_stepz: no such option"]
    message = f"""Parser key "trainer.callbacks":
  Errors:
    - Problem with given class_path 'lightning_debug.MemoryProfilerCallback':
        Option 'memory_high_fractio' is not accepted
{NOT_A_CALLBACK}
  Given value: [{{'class_path': 'lightning_debug.MemoryProfilerCallback', 'init_args': {{'memory_high_fractio': 0.5}}}}]"""
    assert shorten(message).lines() == [
        "trainer.callbacks[0] (lightning_debug.MemoryProfilerCallback).memory_high_fractio: no such option"]


def test_a_message_that_is_not_a_key_keeps_its_first_lines_cut_to_width() -> None:
    message = "\n".join([f"line {i} " + "x" * 300 for i in range(20)])
    lines = shorten(message).lines()
    assert len(lines) == MAX_LINES and lines[0].startswith("line 0 ") and all(len(line) <= MAX_WIDTH for line in lines)
    assert shorten("unrecognized arguments: --trainer.max_stepz 3").lines() == [
        "unrecognized arguments: --trainer.max_stepz 3"]


# --- each pattern pinned to the installed jsonargparse's own wording (issue 44) --------------------------------------
# cli_errors reads jsonargparse's English text where jsonargparse gives nothing structured (one ArgumentError with a
# message); a rule between fields is no longer read from text (callbacks/cli_usage.py uses ConfigError's attributes).
# Each pattern below is matched against a message the installed jsonargparse really prints, so a change of its
# wording fails here, by name, instead of silently giving back the 80-line message.

import re  # noqa: E402
from typing import Any, Optional, Union  # noqa: E402

import pytest  # noqa: E402

from lightning_debug.callbacks import cli_errors  # noqa: E402


class _Trainer:
    def __init__(self, max_steps: int = 1) -> None:
        self.max_steps = max_steps


def _real_message(case: str) -> str:
    """The message of the ArgumentError the installed jsonargparse raises for ``case``."""
    import warnings

    from jsonargparse import ArgumentError, ArgumentParser
    from lightning.pytorch.callbacks import Callback

    def callbacks(name: str, init_args: dict[str, Any]) -> dict[str, Any]:
        return {"callbacks": [{"class_path": f"lightning_debug.{name}", "init_args": init_args}]}

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--callbacks", type=Optional[Union[list[Callback], Callback]])
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--cls", type=Optional[type])
    documents: dict[str, Any] = {
        "range": callbacks("MemoryProfilerCallback", {"memory_high_fraction": 1.5}),
        "unknown_init_arg": callbacks("MemoryProfilerCallback", {"memory_high_fractio": 0.5}),
        "enum": callbacks("AnomalyDetectionCallback", {"anomaly_detection_mode": "explode"}),
        "int": {"steps": "many"},
        "import_path": {"cls": "not a path"},
        "tuple": callbacks("PerformanceProfilerCallback", {"profile_steps": [2, 500]}),
    }
    if case == "group_option":
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(_Trainer, "trainer")
        documents[case] = {"trainer": {"max_stepz": 3}}
    if case == "subcommand_option":
        parser, fit = ArgumentParser(exit_on_error=False), ArgumentParser(exit_on_error=False)
        fit.add_class_arguments(_Trainer, "trainer")
        parser.add_subcommands().add_subcommand("fit", fit)
        documents[case] = {"subcommand": "fit", "fit": {"trainer": {"max_stepz": 3}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            parser.parse_object(documents[case])
        except ArgumentError as error:
            return str(error)
    raise AssertionError(f"jsonargparse accepted the {case} case")


def _lines(message: str) -> list[str]:
    return [line.strip()[2:] if line.strip().startswith("- ") else line.strip() for line in message.splitlines()]


# pattern name in cli_errors -> (the case whose real message it must match, a line it must match)
PINNED: dict[str, tuple[str, str]] = {
    "_KEY": ("range", 'Parser key "memory_high_fraction":'),
    "_CLASS": ("range", "Problem with given class_path 'lightning_debug.MemoryProfilerCallback':"),
    "_NOT_OF_TYPE": ("range", "Not of type UnitFraction: does not conform to restriction v>0 and v<=1"),
    "_NOT_ACCEPTED": ("unknown_init_arg", "Option 'memory_high_fractio' is not accepted"),
    "_GROUP_OPTION": ("group_option", "Group 'trainer' does not accept option 'max_stepz'"),
    "_ENUM": ("enum", "Expected a member of <enum 'AnomalyMode'>: {WARN,RAISE,SKIP,STOP}"),
    "_LITERAL": ("enum", "Expected a typing.Literal['warn', 'raise', 'skip', 'stop']"),
    "_IMPORT_PATH": ("import_path", "Expected a dot import path string: not a path"),
    "_EXPECTED": ("int", "Expected a <class 'int'>. Got value: many"),
}


def test_every_pattern_of_cli_errors_is_pinned_here() -> None:
    patterns = {name for name, value in vars(cli_errors).items() if isinstance(value, re.Pattern)}
    assert patterns == {*PINNED, "_CLASS_NAME"}, "a new pattern over jsonargparse's text needs a pin in PINNED"


@pytest.mark.parametrize("name", sorted(PINNED))
def test_a_pattern_matches_the_installed_jsonargparse_message(name: str) -> None:
    case, line = PINNED[name]
    lines = _lines(_real_message(case))
    assert line in lines, f"jsonargparse's wording changed for {name}: {lines}"
    assert getattr(cli_errors, name).match(line), f"{name} no longer matches jsonargparse's line {line!r}"


def test_the_subcommand_form_and_the_structure_words_are_the_installed_jsonargparse_wording() -> None:
    assert cli_errors._GROUP_OPTION.match(_real_message("subcommand_option").strip())
    lines = _lines(_real_message("range"))
    for word in ("Does not validate against any of the Union subtypes", "Errors:"):
        assert word in lines, word
    assert any(line.startswith("Given value: ") for line in lines) and any(line.startswith("Subtypes: ") for line in lines)
    assert all(any(line.startswith(prefix) for line in lines) for prefix in cli_errors._IRRELEVANT), lines
    # _CLASS_NAME reads the type that _EXPECTED took out of the line above ("<class 'int'>")
    expected = cli_errors._EXPECTED.match(PINNED["_EXPECTED"][1])
    assert expected and cli_errors._CLASS_NAME.match(expected["type"])
    assert any(line.startswith("Subtypes: [tuple[") for line in _lines(_real_message("tuple")))


@pytest.mark.parametrize("case, expected", [
    ("range", ["callbacks[0] (lightning_debug.MemoryProfilerCallback).memory_high_fraction: invalid value",
               "  given: 1.5", "  allowed: a number in (0, 1]"]),
    ("unknown_init_arg", ["callbacks[0] (lightning_debug.MemoryProfilerCallback).memory_high_fractio: no such option"]),
    ("enum", ["callbacks[0] (lightning_debug.AnomalyDetectionCallback).anomaly_detection_mode: invalid value",
              "  given: explode", "  allowed: one of warn, raise, skip, stop"]),
    ("int", ["steps: invalid value", "  given: many", "  allowed: an integer"]),
    ("import_path", ["cls: invalid value", "  given: not a path",
                     "  allowed: an importable class path (package.module.Class)"]),
    ("tuple", ["callbacks[0] (lightning_debug.PerformanceProfilerCallback).profile_steps: invalid value",
               "  given: [2, 500]", "  allowed: [an integer >= 0, an integer in [0, 50]]"]),
    ("group_option", ["trainer.max_stepz: no such option"]),
    ("subcommand_option", ["trainer.max_stepz: no such option"]),
])
def test_the_installed_jsonargparse_messages_shorten_to_the_key_the_value_and_what_is_allowed(
        case: str, expected: list[str]) -> None:
    assert shorten(_real_message(case)).lines() == expected
