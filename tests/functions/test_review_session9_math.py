"""Session 9's last review of the math answer negations: honest phrasings that must score."""

from __future__ import annotations

import pytest

from functions.rewards.math import extract_final, math_answer


@pytest.mark.parametrize(
    ("text", "truth"),
    [
        # a correction after a candidate with its unit: the candidate ran to the sentence's
        # end ("6 apples but 7 apples"), so the correction after it was never read
        ("The answer is not 6 apples but 7 apples.", "7"),
        ("The answer is not 6 hours but 6 minutes.", "6"),
        ("The answer isn't 3 cm, but rather 4 cm.", "4"),
        ("The final answer can't be 10 dollars but 12 dollars.", "12"),
    ],
)
def test_a_correction_after_a_candidate_with_a_unit_is_the_answer(text, truth):
    assert math_answer(text, ground_truth=truth).score == 1.0, extract_final(text)


@pytest.mark.parametrize(
    "text",
    [
        "The answer is not 5 apples but it is close to 5 apples.",
        "The answer is not 5 apples but something near it.",
        "The answer is not 5 when n is even and odd at once but more.",
    ],
)
def test_no_correction_still_reads_nothing(text):
    assert extract_final(text) == (None, "none")


@pytest.mark.parametrize(
    ("text", "truth"),
    [
        # ", not 13" ended the stated answer, "and not 13" did not: "12 and not 13" matched nothing
        ("The answer is 12 and not 13.", "12"),
        ("So the answer is $\\frac{1}{2}$ and not $\\frac{1}{3}$.", "1/2"),
        ("The final answer is 7 and not -7, since lengths are positive.", "7"),
    ],
)
def test_an_answer_then_and_not_another_states_the_first(text, truth):
    assert math_answer(text, ground_truth=truth).score == 1.0, extract_final(text)


def test_and_not_before_a_word_stays_part_of_a_text_answer():
    from functions.rewards.answer import extract_answer

    assert extract_answer("The answer is p and not q.").rstrip(".") == "p and not q"


@pytest.mark.parametrize(
    "text",
    [
        # "the answer is not obvious" judges how hard the answer is to see; it was read as the
        # stated answer ("not obvious"), and the computed one after it never counted
        "The answer is not obvious, but after computing we get 42.",
        "The answer is not immediately clear. Computing, we get 42.",
        "The answer is not straightforward; we compute 6 * 7 = 42.",
        "The final answer is not so simple here: 6 * 7 = 42.",
    ],
)
def test_not_obvious_judges_the_answer_rather_than_states_one(text):
    assert math_answer(text, ground_truth="42").score == 1.0, extract_final(text)


def test_an_answer_that_is_an_adjective_still_stands():
    from functions.rewards.answer import extract_answer

    assert extract_answer("The answer is clear.").rstrip(".") == "clear"
    assert extract_answer("The answer is simple harmonic motion.").rstrip(".") == "simple harmonic motion"
    assert extract_answer("The answer is not simple.").rstrip(".") == "not simple"  # (a group)


@pytest.mark.parametrize(
    "text",
    [
        # the value it is not, after the answer, was read as part of it ("5 rather than 6")
        "The answer is 5 not 6.",
        "The answer is 5 — not 6.",
        "The answer is 5 - not 6.",
        "The answer is 5 rather than 6.",
        "The answer is 5 instead of $6$.",
        # a correction after a dash was not one ("not 6 - it is 5" read nothing)
        "The answer is not 6 - it is 5.",
        "The answer is not 6 — it's 5.",
    ],
)
def test_the_value_it_is_not_is_not_part_of_the_answer(text):
    assert math_answer(text, ground_truth="5").score == 1.0, extract_final(text)


def test_not_before_a_word_stays_part_of_an_answer():
    from functions.rewards.answer import extract_answer

    assert extract_answer("The answer is 3 not counting zero.").rstrip(".") == "3 not counting zero"
    assert extract_answer("The answer is water rather than ice.").rstrip(".") == "water rather than ice"


@pytest.mark.parametrize(
    "text",
    [
        # a question asks whether the answer is not 5; it denies nothing, and withdrew the 5
        "The answer is 5.\nWhat if the answer is not 5? Then 2 + 3 would differ.",
        "The answer is 5. Is it possible that the answer isn't 5? Checking 2 + 3 again, no.",
        "So the answer is $5$. But what if the answer can't be $5$? We verify: 2 + 3 works.",
    ],
)
def test_a_question_whether_the_answer_is_not_it_withdraws_nothing(text):
    assert math_answer(text, ground_truth="5").score == 1.0, extract_final(text)


def test_a_denial_that_is_no_question_still_withdraws():
    assert extract_final("The answer is 5. Wait, the answer is not 5.") == (None, "none")
    assert math_answer("The answer is not 5. What is it then? It is 6.", ground_truth="6").score == 1.0
