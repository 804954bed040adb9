"""A negated statement of an answer ("the answer is not 5", "I don't think the answer is 5")
states no answer: neither it nor a later mention of the value it rejects may be read as the
answer, or a policy learns to hedge its way to the reward. Honest answers around negations
stay right."""

from __future__ import annotations

import time

import pytest

from functions.rewards.answer import extract_answer, stated_answer
from functions.rewards.exact_match import exact_match
from functions.rewards.math import extract_final, math_answer


@pytest.mark.parametrize(
    "text",
    [
        # the fallback read the value the denial rejects, said again later in its sentence
        "the answer is not 5 but it is close to 5",
        "The answer is not 5, but it is close to 5.",
        "the answer is not $5$, but close to 5",
        "The answer is definitely not 5; it is somewhere near 5.",
        "The answer isn't 5 but it is close to 5.",
        "The answer can't be 5, although it is near $5$.",
        "It is not 5 but it is close to 5.",
        "x cannot be 5, though it comes close to 5.",
        # a marker the writer disbelieves states nothing
        "I don't think the answer is 5",
        "I don\u2019t think the answer is 5.",
        "I do not think the answer is $5$.",
        "I don't believe the final answer is 5.",
        "We don't think the correct answer is 5.",
        "I no longer think the answer is 5.",
        "I wouldn't say the answer is 5.",
        "It is not true that the answer is 5.",
        "It's not the case that the answer is 5.",
        "I doubt that the answer is 5.",
        "There is no way the answer is 5.",
        "I don't think the answer is 5 but it is close to 5.",
        # a later negated statement withdraws the answer stated (or boxed) before it, as a
        # later "the answer is not 5" does
        "The answer is 5. Wait, the answer can't be 5.",
        "The answer is 5. Wait, the answer isn't 5.",
        "The answer is 5. Hmm, I don't think the answer is 5.",
        "\\boxed{5}. Hmm, the answer cannot be 5.",
        "\\boxed{5}. Hmm, I don't think the answer is 5.",
        # "is never" is read as the stated answer "never 5", which matches nothing
        "The answer is never 5.",
        "The answer is 5. Wait, the answer is never 5.",
    ],
)
def test_a_negated_statement_of_the_answer_is_not_the_answer(text):
    res = math_answer(text, ground_truth="5")
    assert res.score == 0.0, res.info


@pytest.mark.parametrize(
    "text",
    [
        "the answer is not 5 but it is close to 5",
        "I don't think the answer is 5",
        "It is not 5 but it is close to 5.",
        "The answer isn't 5.",
        "The answer can't be 5.",
    ],
)
def test_a_text_of_negations_alone_has_no_answer(text):
    assert extract_final(text) == (None, "none")


@pytest.mark.parametrize(
    ("text", "gt"),
    [
        ("the answer is 5", "5"),
        ("not 4 but 5, so the answer is 5", "5"),
        ("The answer is 5, not 4", "5"),
        ("\\boxed{5}", "5"),
        ("x is not 3, so x = 5", "5"),
        # a box is explicit: a negation elsewhere, before it or of another value, leaves it
        ("I don't think the answer is 5. \\boxed{5}", "5"),
        ("The answer is not 5. Recomputing, \\boxed{5}.", "5"),
        ("\\boxed{5}. The answer cannot be 4.", "5"),
        ("\\boxed{5}. I don't think the answer is 4.", "5"),
        # a negation of another value leaves the answer stated before or after it
        ("The answer is 5. I don't think the answer is 4.", "5"),
        ("The answer is 5. Note that the answer can't be 4.", "5"),
        ("I don't think the answer is 4. The answer is 5.", "5"),
        ("No, I don't think the answer is 4; the answer is 5.", "5"),
        # a correction after the rejected value is the answer
        ("I don't think the answer is 4, it is 5.", "5"),
        ("The answer isn't 4 but 5.", "5"),
        ("The answer can't be 4, so it is 5.", "5"),
        ("It takes not 2 hours but 2 days.", "2"),
        ("It is not 5 hours, it's 5 days.", "5"),
        ("Not 5 but 5 + 1 = 6 apples.", "6"),
        # a negation that is not of the answer ("don't", "not" elsewhere in the sentence)
        ("I don't think so. The answer is 5.", "5"),
        ("If we don't round, the answer is 5.", "5"),
        ("Whether or not we count zero the answer is 5.", "5"),
        ("I'm not sure, but the answer is 5.", "5"),
        ("We cannot simplify further, so the answer is 5.", "5"),
        ("I don't think we need the second equation: the answer is 5.", "5"),
        ("It is not hard to see that the answer is 5.", "5"),
        ("It's not surprising that the answer is 5.", "5"),
        ("x cannot be 0, so x = 5", "5"),
        ("Since 7 is not 0, we divide: 35 / 7 = 5", "5"),
        ("We can't have 5 apples, since 5 > 3; so we have 3.", "3"),
        # the rejected value stated again in its sentence, by "=" or "is": read
        ("f(2) doesn't equal 5, so we try x = 3: f(3) = 5", "5"),
        ("The first digit cannot be 0, so the last digit is 0", "0"),
        # the value said again in a later sentence is read as it would be with no denial
        ("The answer is not 5. Recomputing: 2 + 3 = 5.", "5"),
        # GSM8K and MATH style
        ("She doesn't have 12 cookies left since she ate 2: 12 - 2 = 10.\n#### 10", "10"),
        ("The remainder is not 0, so $n$ is odd. Hence $n = 7$.", "7"),
        ("Since $x$ is not $2$, we cancel to get $x + 2$, so the limit is $4$.", "4"),
    ],
)
def test_an_honest_answer_around_negations_is_read(text, gt):
    res = math_answer(text, ground_truth=gt)
    assert res.score == 1.0, res.info


@pytest.mark.parametrize(
    "text",
    [
        # a question the text answers "No" states nothing: the fallback read its 5
        "Is the answer 5? No.",
        "Could it be 5? No.",
        "Is it $5$? No.",
        "Is x = 5? Nope.",
        "Is the answer 5?\nNo.",
        "Is the answer 5? Hmm, no.",
        "Is the answer 5? **No**.",
        "We check: is 2 + 3 = 5? No!",
        "So 5? No, that is wrong.",
        # ... and so does a stated answer that asks (it read "5? No", which matched nothing,
        # and the correction after it was never read: see below)
        "The answer is 5? No.",
        "Answer: $5$? No.",
        "The answer is 5. Hmm, the answer is 5? No.",
    ],
)
def test_a_question_answered_no_states_nothing(text):
    assert extract_final(text) == (None, "none")
    assert math_answer(text, ground_truth="5").score == 0.0


@pytest.mark.parametrize(
    ("text", "gt"),
    [
        ("Is the answer 5? Yes.", "5"),
        ("Is the answer 5? Yes, it is.", "5"),
        ("Is it 5? No, it is 6.", "6"),
        ("Is it 5? No. It is 6.", "6"),
        ("The answer is 5? No, it is 6.", "6"),
        ("The answer is 5? No. The answer is 6.", "6"),
        ("The answer is 6. The answer is 5? No.", "6"),
        ("So the answer is 5? Yes.", "5"),
        ("The answer is $5$? Yes, since 2 + 3 = 5.", "5"),
        ("Is x negative? No, so x = 4.", "4"),
        ("x = 4. Is 4 < 0? No.", "4"),
        ("Is 12 divisible by 5? No, so 12 apples stay.", "12"),
        ("What is 2 + 3? 5. Is that more than 10? No.", "5"),
        ("Is there a real root? No real root exists, so the count is 0.", "0"),  # "No real": no reply
        # a later statement of the value is a change of mind, read as after any rejection
        ("Is it 5? No. Recomputing: 2 + 3 = 5.", "5"),
    ],
)
def test_an_honest_answer_around_questions_is_read(text, gt):
    res = math_answer(text, ground_truth=gt)
    assert res.score == 1.0, res.info


@pytest.mark.parametrize(
    "text",
    [
        # after a rejection, the rejected value named as a point of comparison ("close to 5",
        # "near 5", "about 5", "more than 5") is not said again, in any later sentence (the
        # rule for the same sentence: see above); the fallback read it
        "the answer is not 5. It is close to 5.",
        "The answer is not 5. It is somewhere near 5.",
        "The answer isn't 5. It is about $5$.",
        "It is not 5. It is a bit more than 5.",
        "Is the answer 5? No. It is close to 5.",
    ],
)
def test_a_rejected_value_named_as_a_point_of_comparison_is_not_said_again(text):
    assert extract_final(text) == (None, "none")
    assert math_answer(text, ground_truth="5").score == 0.0


@pytest.mark.parametrize(
    ("text", "gt"),
    [
        # a later statement of the rejected value is a change of mind, read as before
        ("The answer is not 5. Recomputing: 2 + 3 = 5.", "5"),
        ("The answer is not 5. After rechecking, it is 5.", "5"),
        ("The answer is not 5. It is close to 6.", "6"),
        # a comparison with a value nobody rejected is read as before
        ("It takes about 7 hours.", "7"),
    ],
)
def test_an_honest_answer_around_comparisons_is_read(text, gt):
    res = math_answer(text, ground_truth=gt)
    assert res.score == 1.0, res.info


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        ("I don't think the answer is Paris.", "Paris", 0.0),
        ("The answer is Paris. Hmm, I don't think the answer is Paris.", "Paris", 0.0),
        ("The answer is Paris. I don't think the answer is London.", "Paris", 1.0),
        ("The answer is Paris. I don't think the answer is London.", "London", 0.0),
        ("The answer isn't B.", "B", 0.0),
        ("I don't think the answer is B. The answer is C.", "C", 1.0),
        ("The answer is Paris? No.", "Paris", 0.0),
        ("The answer is Paris? Yes.", "Paris", 1.0),
    ],
)
def test_text_answers_follow_the_same_rule(text, gt, score):
    # exact_match reads the same stated answer (answer.extract_answer)
    assert exact_match(text, ground_truth=gt) == score, extract_answer(text)


def test_a_disbelieved_answer_is_stated_as_the_denial():
    # what stated_answer returns for a denial says so, and matches no answer
    assert stated_answer("I don't think the answer is 5. Hmm.") == "I don't think the answer is 5"
    assert stated_answer("The answer can't be 5. Hmm.") == "can't be 5"


@pytest.mark.parametrize(
    "text",
    [
        "I don't think the answer is 5 " * 50_000,
        "the answer isn't 5 " * 50_000,
        "it is not 5 but close to 5 " * 50_000,
        "the answer is not 5 but it is close to 5 " * 50_000,
    ],
    ids=["disbelief", "negated_marker", "fallback", "denied_fallback"],
)
def test_negation_handling_is_linear(text):
    t0 = time.monotonic()
    assert math_answer(text, ground_truth="5").score == 0.0
    assert time.monotonic() - t0 < 10.0  # ~1 s linear on a loaded machine; quadratic is hours
