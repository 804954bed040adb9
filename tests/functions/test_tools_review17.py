"""The built-in tools as a policy calls them thousands of times a step, with model-written
arguments: values the calculator answered wrongly, and arguments that came back as the
tool's own internals (an ``AttributeError``) instead of a message saying what to pass."""

from __future__ import annotations

import pytest

from functions.tools.calculator import calculator
from functions.tools.python import run_python
from functions.tools.search import check_arguments


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        # an int past a float's range times a float was refused as "too large for a float",
        # its result well inside it: the int was converted on its own, and overflowed
        ("10 ** 400 * 1e-300", "1e+100"),
        ("10 ** 400 / 1e300", "1e+100"),
        ("1e-300 * 10 ** 400", "1e+100"),
        ("10 ** 400 * 0.0", "0"),
        ("10 ** 400 // 1e300", "1e+100"),
        ("(10 ** 400 + 7) % 2.5", "2"),
        ("10 ** 400 - 10 ** 400 + 0.5", "0.5"),
    ],
)
def test_an_int_past_a_floats_range_with_a_float_is_answered_when_the_result_fits(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression", ["10 ** 400 * 1.0", "10 ** 400 + 0.5", "10 ** 400 / 1e-300"])
def test_an_int_past_a_floats_range_with_a_float_is_still_refused_when_the_result_is(expression):
    with pytest.raises(ValueError, match="too large for a float"):
        calculator(expression)


@pytest.mark.parametrize(
    ("expression", "hint"),
    [
        # "invalid syntax" told the policy nothing of what it wrote, or what to write instead
        ("50%", "percentage"),
        ("200 * 15%", "percentage"),
        ("15% of 80", "percentage"),
        ("5!", "factorial"),
        ("2(3 + 4)", "put * before '(' to multiply"),
        ("(1 + 2)(3 + 4)", "put * before '(' to multiply"),
    ],
)
def test_notations_a_model_types_are_refused_saying_what_to_write(expression, hint):
    with pytest.raises(ValueError) as e:
        calculator(expression)
    assert hint in str(e.value), str(e.value)


def test_a_call_of_a_name_still_says_calls_are_not_allowed():
    with pytest.raises(ValueError, match="function calls are not allowed"):
        calculator("sqrt(4)")


@pytest.mark.parametrize("expression", [5, None, ["1 + 1"], b"1 + 1"])
def test_calculator_called_with_no_string_says_what_to_pass(expression):
    # envpool's in-process bridge calls the tool as it is, without the fabric's argument
    # check: "AttributeError: 'int' object has no attribute 'strip'" was what the policy read
    with pytest.raises(ValueError, match="expression must be a string"):
        calculator(expression)


class _NoSandbox:
    """A verifier that must not be reached: the arguments are refused first."""

    @property
    def sandbox(self):
        raise AssertionError("the run started on arguments that should have been refused")


@pytest.mark.parametrize(
    ("code", "stdin", "message"),
    [
        (5, "", "code must be a string"),
        (None, "", "code must be a string"),
        (["print(1)"], "", "code must be a string"),
        ("print(1)", 5, "stdin must be a string"),
        ("print(1)", None, "stdin must be a string"),
    ],
)
def test_python_called_with_no_string_says_what_to_pass(code, stdin, message):
    with pytest.raises(ValueError, match=message):
        run_python(_NoSandbox(), code, stdin)  # type: ignore[arg-type]


def test_a_search_query_with_a_lone_surrogate_is_refused_saying_where():
    # the calculator and python refuse one; search echoed it back in its answer, text no
    # UTF-8 encodes, for whatever encodes the observation next
    with pytest.raises(ValueError, match="lone surrogate"):
        check_arguments("speed of \ud800 light", 3)


@pytest.mark.parametrize("module", ["calculator", "search", "python"])
def test_each_tools_schema_is_the_arguments_it_takes(module):
    # what the policy is shown (OpenAI's tool format) and what the fabric accepts: the same
    # names, the same required ones, and no others (extra fields are refused)
    import importlib

    tool = importlib.import_module(f"functions.tools.{module}")
    spec = getattr(tool, module).__fabric_spec__
    fn = tool.OPENAI_SCHEMA["function"]
    params = fn["parameters"]
    assert tool.OPENAI_SCHEMA["type"] == "function" and fn["name"] == spec.name
    assert params["type"] == "object" and params["additionalProperties"] is False
    assert sorted(params["required"]) == sorted(p.name for p in spec.params if p.required)
    assert set(params["properties"]) == {p.name for p in spec.params}
    assert not spec.accepts_extra


def test_the_python_tools_schema_says_what_the_policy_sees_and_how_much_code_it_takes():
    # a program over 256 KiB is refused and only the first 4,000 characters of its output
    # are shown, but neither was in what the policy is shown of the tool: it printed a long
    # table to read, or sent a long program, and learnt the limit only from a cut
    from functions.tools.python import MAX_SHOWN, OPENAI_SCHEMA
    from functions.verifiers.verify import MAX_CODE_BYTES

    fn = OPENAI_SCHEMA["function"]
    assert f"{MAX_SHOWN:,} characters" in fn["description"], fn["description"]
    code = fn["parameters"]["properties"]["code"]["description"]
    assert f"{MAX_CODE_BYTES >> 10} KiB" in code, code


@pytest.mark.parametrize(
    ("expression", "hint"),
    [
        # "Tuple is not allowed" and "invalid syntax" said nothing the policy could act on
        ("1,234 + 5", "thousands separators"),
        ("2 + 3 =", "only the expression"),
        ("x = 2 + 3", "only the expression"),
        ("$5 + 3", "currency"),
        ("5 \u20ac * 3", "currency"),
    ],
)
def test_more_notations_a_model_types_are_refused_saying_what_to_write(expression, hint):
    with pytest.raises(ValueError) as e:
        calculator(expression)
    assert hint in str(e.value), str(e.value)


@pytest.mark.parametrize("code", ["```python\nprint(1)\n```", "\n```\nprint(1)\n```\n", "```py\nprint(1)"])
def test_python_code_in_a_markdown_fence_is_refused_saying_to_pass_the_program(code):
    # no program starts with ``` (a syntax error): the policy pasted its answer's fence, and
    # read a SyntaxError at line 1 after a sandbox run
    with pytest.raises(ValueError, match="Markdown code fence"):
        run_python(_NoSandbox(), code)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        # an int past a float's range to a float power was taken as "huge" or "tiny" by the
        # exponent's sign alone: a power of 0.0 read 0 (it is 1), one of -0.5 read 0
        ("(10 ** 400) ** 0.0", "1"),
        ("(10 ** 400) ** -0.5", "1e-200"),
        ("(10 ** 400) ** 0.5", "1e+200"),
        ("(2 ** 5000) ** 0.125", "1.39234637988959e+188"),  # 2 ** 625
        ("(2 ** 1024 - 1) ** 0.5", "1.34078079299426e+154"),  # (its float rounds to 2 ** 1024)
        ("(-(10 ** 400)) ** -1.0", "0"),
        ("(10 ** 400) ** -2.0", "0"),
    ],
)
def test_an_int_past_a_floats_range_to_a_float_power_is_its_value(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("(10 ** 400) ** 0.9", "too large for a float"),
        ("(-(10 ** 400)) ** 3.0", "too large for a float"),
        ("(-(10 ** 400)) ** 0.5", "not a real number"),
        ("(-(10 ** 400)) ** -0.5", "not a real number"),
        # a float's own overflow, the int within its range: as before
        ("10 ** 400.0", "too large for a float"),
        ("(-10) ** 401.0", "too large for a float"),
        ("2 ** 1024.0", "too large for a float"),
    ],
)
def test_an_int_past_a_floats_range_to_a_float_power_is_refused_for_what_it_is(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)
