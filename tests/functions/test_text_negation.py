"""Text answers follow the rule numbers do (see test_math_negation.py): a negated statement
("the answer is not Paris", "the answer isn't Paris", "I don't think the answer is Paris",
"Paris? No") never scores the value it denies, and a correction after it ("..., it is London",
"... . It is London.", "but London", "rather London", "No, it is London") is the answer. A text
answer may itself be a negation ("not applicable", "Not Guilty", "cannot be determined"): with
nothing that corrects it, "not X" reads as what it says, which matches X never and a ground
truth that is that negation."""

from __future__ import annotations

import time

import pytest

from functions.rewards.answer import extract_answer, stated_answer
from functions.rewards.exact_match import exact_match
from functions.rewards.math import math_answer

NEGATIONS = [
    "The answer is not Paris",
    "The answer is definitely not Paris",
    "The answer isn't Paris",
    "The answer can't be Paris",
    "The answer cannot be Paris",
    "I don't think the answer is Paris",
    "It is not true that the answer is Paris",
]
CORRECTIONS = [
    ", it is London.",
    ", it's London.",
    "; it is London.",
    ". It is London.",
    ". It's London.",
    " but London.",
    ", but rather London.",
    " but rather London.",
    ", rather London.",
    "; rather, London.",
    " but instead London.",
    " \u2014 it is London.",
]


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("negation", NEGATIONS)
def test_a_correction_after_a_text_denial_is_the_answer(negation, correction):
    # the denial was read as the answer ("not Paris"), or the rest after it (", it is London.")
    text = negation + correction
    assert exact_match(text, ground_truth="London") == 1.0, extract_answer(text)
    assert exact_match(text, ground_truth="Paris") == 0.0, extract_answer(text)


@pytest.mark.parametrize(
    ("text", "gt"),
    [
        # a question answered "No", then corrected, after a marker or on the last line
        ("The answer is Paris? No, it is London.", "London"),
        ("The answer is Paris? No. It is London.", "London"),
        ("Paris? No, it is London.", "London"),
        ("Is it Paris? No, it is London.", "London"),
        ("Is it Paris? Hmm, no. It's London.", "London"),
        ("Is it Paris?\nNo, it is London.", "London"),
        ("Could it be Paris? Nope, rather London.", "London"),
        # a denial on the last line, with no marker, then corrected
        ("It isn't Paris, it is London.", "London"),
        ("It's not Paris, it's London.", "London"),
        ("It is not Paris but London.", "London"),
        ("Not Paris, but rather London.", "London"),
        ("Work.\nThe city is not Paris; it is London.", "London"),
        # a number the same way (the last line was read whole)
        ("Is it 5? No, it is 6.", "6"),
        ("It isn't 5, it is 6.", "6"),
        # a name of a few words, denied or corrected
        ("The answer is not the Eiffel Tower, it is the Louvre.", "Louvre"),
        ("The answer is not New York but Washington.", "Washington"),
        (
            "The answer is not the Statue of Liberty. It is the Empire State Building.",
            "Empire State Building",
        ),
        # a text denial corrected by a number, and a yes/no answer
        ("The answer is not infinity, it is 5.", "5"),
        ("The answer is not yes, it is no.", "No"),
        # a withdrawn answer, then the denial's correction
        ("The answer is Paris. Wait, the answer is not Paris, it is London.", "London"),
        ("\\boxed{Paris}. Hmm, the answer isn't Paris, it is London.", "London"),
        # a clause after the correction is not part of it
        ("The answer is not Paris, it is London, the capital of England.", "London"),
        # after "Answer:" as after "the answer is" (a number's too)
        ("Answer: not Paris, it is London", "London"),
        ("**Answer:** not Paris, but London", "London"),
        ("The answer: not Paris. It is London.", "London"),
        ("Answer: not 5, it is 6", "6"),
    ],
)
def test_a_rejection_then_its_correction_reads_the_correction(text, gt):
    assert exact_match(text, ground_truth=gt) == 1.0, extract_answer(text)


@pytest.mark.parametrize(
    "text",
    [
        *(negation + "." for negation in NEGATIONS),
        *(negation for negation in NEGATIONS),
        "The answer is Paris? No.",
        "Paris? No.",
        "Is it Paris? No.",
        "It isn't Paris.",
        # a later denial withdraws the answer stated or boxed before it
        "The answer is Paris. Wait, the answer is not Paris.",
        "The answer is Paris. Hmm, the answer isn't Paris.",
        "The answer is Paris. Hmm, the answer can't be Paris.",
        "\\boxed{Paris}. Hmm, the answer is not Paris.",
        "\\boxed{Paris}. Hmm, the answer cannot be Paris.",
        # what follows the denial is no correction: a remark, a comparison, a verdict
        "The answer is not Paris but it is close to Paris.",
        "The answer is not Paris. It is important to note that Paris is in France.",
        "The answer is not Paris, but I am not sure.",
        "The answer is not Paris. It is clear from the map.",
        "The answer is not Paris, it is correct.",
        "It isn't Paris, but it is close to Paris.",
    ],
)
def test_a_text_denial_never_scores_the_denied_value(text):
    assert exact_match(text, ground_truth="Paris") == 0.0, extract_answer(text)


@pytest.mark.parametrize(
    ("text", "gt"),
    [
        ("The answer is the Eiffel Tower. Wait, the answer is not the Eiffel Tower.", "Eiffel Tower"),
        ("The answer is New York. Hmm, the answer isn't New York.", "New York"),
    ],
)
def test_a_denial_of_a_name_of_several_words_withdraws_it(text, gt):
    # only the denial's first word was compared ("the", "New"): the name stood
    assert exact_match(text, ground_truth=gt) == 0.0, extract_answer(text)


@pytest.mark.parametrize(
    "text",
    [
        "The answer is London. Note that the answer is not Paris.",
        "The answer is London. Hmm, the answer isn't Paris.",
        "The answer is London. The answer can't be Paris.",
        "\\boxed{London}. Note that the answer is not Paris.",
        "The answer is London. I don't think the answer is Paris.",
    ],
)
def test_a_denial_of_another_value_leaves_the_answer_before_it(text):
    # "not Paris" was read as the last stated answer
    assert exact_match(text, ground_truth="London") == 1.0, extract_answer(text)


@pytest.mark.parametrize(
    ("text", "gt"),
    [
        ("The answer is not applicable.", "not applicable"),
        ("The answer is: not applicable", "Not applicable"),
        ("The answer is Not Guilty.", "Not Guilty"),
        ("The answer is not guilty.", "not guilty"),
        ("The answer is NOT GUILTY.", "not guilty"),
        ("The answer is None of the above.", "None of the above"),
        ("The answer is: cannot be determined.", "cannot be determined"),
        ("The answer cannot be determined.", "cannot be determined"),
        ("The answer can't be determined.", "Can't be determined"),
        ("The answer is not entailment.", "not entailment"),
        ("Answer: not_entailment", "not entailment"),
        ("The answer is No.", "No"),
        ("The answer is no.", "No"),
        ("Answer: No", "No"),
        ("The answer is No, it is not possible.", "No"),
        ("The answer is No. It is not possible.", "No"),
        ("The answer is No solution.", "No solution"),
        ("The answer is: no solution", "No solution"),
        ("The answer is not possible.", "not possible"),
        ("The answer is not a real number.", "not a real number"),
        # a clause or a remark after an honest negation is not a correction of it
        ("The answer is not applicable, because nothing was measured.", "not applicable"),
        (
            "The answer is not applicable. It is important to note that nothing was measured.",
            "not applicable",
        ),
        ("The answer is not guilty. It is clear from the evidence.", "not guilty"),
        ("The answer is not guilty, but I am not sure.", "not guilty"),
        ("The answer is not guilty. It is because the alibi holds.", "not guilty"),
        ("The answer is not possible, since x > 3 and x < 2.", "not possible"),
        ("The answer cannot be determined.\n\nExplanation: the passage never says.", "cannot be determined"),
        ("Answer: not applicable", "not applicable"),
        ("Answer: Not Guilty", "Not Guilty"),
        ("The answer is not only Paris but also Lyon.", "not only Paris but also Lyon"),
        # a later honest negation after a denial of another value: the denial stands aside
        ("The answer is cannot be determined. I don't think the answer is A.", "cannot be determined"),
        # with nothing that corrects it, a denial reads as what it says: it matches the
        # ground truth that is that negation, never the value it denies
        ("The answer is not Paris.", "not Paris"),
        ("Not Guilty", "Not Guilty"),
        ("No", "No"),
    ],
)
def test_an_honest_answer_that_holds_not_or_no_is_read(text, gt):
    assert exact_match(text, ground_truth=gt) == 1.0, extract_answer(text)


@pytest.mark.parametrize(
    "text",
    [
        "the answer is not Paris, " * 50_000,
        "the answer is not Paris. It is " * 40_000,
        "The answer is not Paris" + " " * 1_000_000 + "x",
        "The answer is not Paris" + " " * 1_000_000 + ". It is London",
        # a run of spaces after a number's denial: each correction's look split it in n^2 ways
        "The answer is not 5" + " " * 1_000_000 + "x",
        "The answer is not 5 apples" + " " * 1_000_000 + ",x",
        "The answer is Paris? No, " * 50_000,
        "Paris? No, " * 100_000,
        "It isn't Paris, " * 70_000,
        "It isn't Paris" + " " * 1_000_000 + "x",
        "not " * 250_000,
        "The answer is the Eiffel Tower. The answer is not the Eiffel Tower. " * 15_000,
        # each denied name is read for what it names, once an answer before them is compared
        "The answer is London. " + "the answer isn't " * 55_000,
    ],
    ids=[
        "denials",
        "denials_it_is",
        "spaces",
        "spaces_correction",
        "number_spaces",
        "number_unit_spaces",
        "questions",
        "replies",
        "line_denials",
        "line_spaces",
        "nots",
        "withdrawn_names",
        "negated_marks",
    ],
)
def test_text_negation_handling_is_linear(text):
    t0 = time.monotonic()
    exact_match(text, ground_truth="London")
    assert time.monotonic() - t0 < 10.0  # ~1 s linear on a loaded machine; quadratic is hours


@pytest.mark.parametrize(
    ("text", "gt"),
    [
        # a denial of a word reads the numbers after it, as a denial of a number does
        ("The answer can't be negative, so x = 5", "5"),
        ("The answer is not an integer; it is $\\frac{5}{2}$.", "\\frac{5}{2}"),
        ("The answer is 5. Note that the answer is not an integer multiple of 3.", "5"),
        ("The answer is not x = 4 but it is close: x = 5", "5"),
    ],
)
def test_math_answer_reads_values_around_a_denied_word(text, gt):
    res = math_answer(text, ground_truth=gt)
    assert res.score == 1.0, res.info


def test_a_denied_word_states_what_it_says():
    assert stated_answer("The answer is not applicable. Hmm.") == "not applicable"
    assert stated_answer("The answer cannot be determined. Hmm.") == "cannot be determined"
    assert stated_answer("The answer is London. The answer is not Paris.") == "London"
