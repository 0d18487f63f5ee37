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
