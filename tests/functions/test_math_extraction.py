"""The ``math_answer`` reward's extraction of the final answer from a completion: the
forms (boxed, stated in common formats, after the thinking, the later of box and marker),
where a stated answer ends, a rejected candidate or a negated statement that is not the
answer, nothing after the thinking."""

from __future__ import annotations

import pytest

from functions.rewards.math import extract_final, math_answer

# ----------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{1} then \\boxed{\\frac{1}{2}}", ("\\frac{1}{2}", "boxed")),
        ("The answer is 17.", ("17.", "answer_is")),
        ("Answer: 2\\sqrt{2}", ("2\\sqrt{2}", "answer_is")),
        ("5 red and 7 blue, 1,200 in total", ("1,200", "last_number")),
        ("ratio 3/4 overall", ("3/4", "last_number")),
        # a power is one number: its exponent alone is not the answer (2^{10} was read as 10)
        ("The value is 2^{10}.", ("2^{10}", "last_number")),
        ("so it comes to 10^3", ("10^3", "last_number")),
        ("a rate of 2^{-3} per step", ("2^{-3}", "last_number")),
        # so is a number in scientific notation: its power of ten alone is not the answer
        # (with the unit the prose states after it, which the units rule compares)
        ("The speed is 3 \\times 10^8 m/s.", ("3 \\times 10^8 m/s", "last_number")),
        ("so we get 1.5 \\cdot 10^{-3}", ("1.5 \\cdot 10^{-3}", "last_number")),
        ("about 6.02*10^23 molecules", ("6.02*10^23", "last_number")),
        ("no digits here", (None, "none")),
    ],
)
def test_extract_final(text, expected):
    assert extract_final(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Minerva / MATH: the answer is the first sentence, not the rest of the line
        ("The final answer is $\\frac{1}{2}$. I hope it is correct.", ("$\\frac{1}{2}$", "answer_is")),
        ("Final Answer: The final answer is $5$. I hope it is correct.", ("$5$", "answer_is")),
        ("The answer is 3. Because 1 + 2 = 3.", ("3", "answer_is")),
        ("The answer is 3.5 exactly", ("3.5 exactly", "answer_is")),
        ("**Final Answer:** 42", ("42", "answer_is")),
        ("The answer is:\n\n42", ("42", "answer_is")),
        # the last stated answer wins, whichever its form ("the answer is" beat a later Answer:)
        ("The answer is 3.\nAnswer: 5", ("5", "answer_is")),
        ("Answer: 5\nOn reflection, the answer is 3.", ("3.", "answer_is")),
        # no box and no stated answer: the last math span when nothing follows it
        ("... so $x = \\frac{3}{4}$", ("\\frac{3}{4}", "last_math")),
        ("so \\[ y = 2 + 3 = 5 \\]", ("5", "last_math")),
        ("the point $x = 1, y = 2$", ("x = 1, y = 2", "last_math")),
        ("so x = \\frac{3}{4}", ("\\frac{3}{4}", "last_number")),  # \frac{3}{4} is one number
        # with thousands separators too (\frac{1,000}{2} was read as 2)
        ("so it is \\frac{1,000}{2} each", ("\\frac{1,000}{2}", "last_number")),
        ("The total is $5$ apples, 12 left", ("12", "last_number")),  # a number after the span
        ("we need $x \\geq 1$", ("1", "last_number")),  # an inequality: as before
        ("it costs \\$5 and \\$7", ("7", "last_number")),  # escaped dollars are not math
        # a variable the prose names after the final number is not the answer
        ("So there are 42 ways, one for each value of $n$.", ("42", "last_number")),
        ("Hence the sum is 42 for every integer $k$.", ("42", "last_number")),
        ("The area is 12 square units when $a = b$.", ("12", "last_number")),
        ("Thus the minimum value is 5, attained at $x = y$.", ("5", "last_number")),
        ("We need 7 more coins, i.e. $c_{\\text{total}}$.", ("7", "last_number")),
        ("The probability is 0.25, since each outcome of $X$ is equally likely.", ("0.25", "last_number")),
        # ... while an expression that ends the text is
        ("Step 1 gives the sum, so it is $a + b$.", ("a + b", "last_math")),
        ("so $x = \\sqrt{2}$ for each $n$", ("\\sqrt{2}", "last_math")),
        # an inequality after the answer is a condition: the span before it states the answer
        ("We get $f(n) = 3$ for all $n \\ge 1$.", ("3", "last_math")),
        ("We get $f(n) = 3$ for all $n \\ge1$.", ("3", "last_math")),  # \ge ends before the digit
        ("Thus $x=\\frac34$, since $4 > 3$.", ("\\frac34", "last_math")),
        # a prose number after it: the last number, though not the condition's (it read 3)
        ("Thus $x = 2$, then 5 more, since $4 > 3$.", ("5", "last_number")),
        # "!" before an operator is a factorial (the sentence goes on); at the end, excitement
        ("The answer is 5! = 120.", ("120.", "answer_is")),  # a chain: its last side
        ("The answer is 3! + 1 = 7", ("7", "answer_is")),
        ("The answer is 5!", ("5", "answer_is")),
        ("The answer is **5!**", ("5", "answer_is")),
        ("The answer is 5! That is all.", ("5", "answer_is")),
    ],
)
def test_extract_final_forms(text, expected):
    assert extract_final(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # the last number was the bound of a condition after the stated value: "since x > 0"
        # read 0. A relation that a reason introduces (since, because, as, given, assuming,
        # satisfies, check) or a consequence follows ("x > 0 so") is a premise: after another
        # number it is not read; nor is a domain's (for, where, if, when, such that) after a
        # value stated in its sentence (x = 4, x is 4)
        ("So x = 4 since x > 0.", ("4", "last_number")),
        ("So x is 4, not -4, since x > 0.", ("4", "last_number")),
        ("x = 4, not -4, because x > 0", ("4", "last_number")),
        ("Thus n = 12 for n >= 1.", ("12", "last_number")),
        ("so k = 7 where k \u2265 2", ("7", "last_number")),
        ("Hence b = 5, given that a < 3.", ("5", "last_number")),
        ("We get x = 2, assuming b \u2260 0.", ("2", "last_number")),
        ("We get x = 2, assuming b != 0.", ("2", "last_number")),
        ("x = 9 if x > 3", ("9", "last_number")),
        ("It is 6 when 2 < t \\le 5.", ("6", "last_number")),
        ("So x = 4 as 0 < x < 10.", ("4", "last_number")),
        ("so y = 3 for all real numbers x > 0", ("3", "last_number")),
        ("x = 4, which satisfies x > 0.", ("4", "last_number")),
        ("We have x = 4. Check: 4 > 0.", ("4", "last_number")),
        ("x = 4. This works because x > 0.", ("4", "last_number")),
        # a reason is no value after any other number, stated or not (they read 10 and 10)
        ("He needs 4 more boxes since 4 * 3 > 10.", ("4", "last_number")),
        ("So 12 people, as 12 > 10.", ("12", "last_number")),
        ("We find x = 4; x > 0 so it is valid.", ("4", "last_number")),
        ("We find x = 4; x > 0, hence it is valid.", ("4", "last_number")),
        ("We find x = 4 and x \\geq 0 \\implies it is valid.", ("4", "last_number")),
        ("So x = 4 since $x \\gt 0$.", ("4", "last_number")),
        ("So x = 4 since $x \\neq 0$.", ("4", "last_number")),
        # a condition's numbers on both sides ("since 4 > 3") and in a span the math rule reads
        ("Thus $x=\\frac34$, since 4 > 3.", ("\\frac34", "last_math")),
        ("So $x = 4$, since $x > 0$.", ("4", "last_math")),
        # a condition before the value, or a value stated after it, read as before
        ("Since x > 0, x = 4.", ("4", "last_number")),
        ("The answer is 0 since x > 0 gives nothing.", ("0", "answer_is")),
        ("It is 0 since x > 0 gives nothing.", ("0", "last_number")),
        # a relation that concludes states its range: its bound is read as before (an
        # inequality answer is read whole only where stated: "the answer is x > 3")
        ("Solve x - 3 > 0: x > 3", ("3", "last_number")),
        ("Adding 3 to both sides, x > 3.", ("3", "last_number")),
        ("So x = 4 and the range is y > 7.", ("7", "last_number")),
        # ... and so is a condition after no stated value: its bound is all the text offers
        ("The inequality holds when n \u2265 6.", ("6", "last_number")),
        ("We try 3 cases. It holds when n \u2265 6.", ("6", "last_number")),
        ("Since x > 0.", ("0", "last_number")),
        ("Since 2 < x < 5.", ("5", "last_number")),
        # a domain in a sentence of its own may be what it concludes
        ("Thus S = n(n+1)/2. This exceeds 100 for n \\ge 14.", ("14", "last_number")),
        # the bound of a relation after "=" is the relation's, not the value's ("x = 4 > 3")
        ("Since 0 < x = 4, done.", ("4", "last_number")),
    ],
)
def test_a_condition_is_not_the_stated_value(text, expected):
    assert extract_final(text) == expected


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        ("So x = 4 since x > 0.", "4", 1.0),
        ("So x = 4 since x > 0.", "0", 0.0),
        ("x = 4, not -4, because x > 0", "-4", 0.0),
        # an inequality stated as the answer is its interval
        ("Solving x - 3 > 0, the answer is x > 3.", "x > 3", 1.0),
        ("Solving x - 3 > 0, the answer is $x > 3$.", "(3, \\infty)", 1.0),
        ("Solving x - 3 > 0, the answer is $x > 3$.", "3", 0.0),
    ],
)
def test_a_condition_is_not_the_stated_value_scored(text, gt, score):
    res = math_answer(text, ground_truth=gt)
    assert res.score == score, res.info


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        ("The final answer is $\\frac{1}{2}$. I hope it is correct.", "1/2", 1.0),
        ("So the answer is 0.5. Let me double-check: yes.", "\\frac{1}{2}", 1.0),
        ("... so $x = \\frac{3}{4}$", "3/4", 1.0),
        ("x = \\frac{3}{4}", "0.75", 1.0),
        ("The answer is 3.\nAnswer: 5", "5", 1.0),
        ("The answer is 3.\nAnswer: 5", "3", 0.0),
        # a word that says "about this value" before a number goes; one that changes it stays
        ("The answer is approximately 3.14.", "3.14", 1.0),
        ("The answer is about 7 hours.", "7", 1.0),
        ("The answer is approx. 3.14", "3.14", 1.0),
        ("The answer is roughly 12", "12", 1.0),
        ("\\boxed{x \\approx 0.33}", "0.33", 1.0),
        ("The answer is about 8.", "7", 0.0),
        ("The answer is at least 7.", "7", 0.0),
        ("The answer is nearly 7.", "7", 0.0),
        ("The answer is approximately 3.14.", "\\pi", 0.0),  # still a rounded decimal against pi
        # factorials
        ("The answer is $5!$.", "120", 1.0),
        ("\\boxed{\\frac{6!}{3!}}", "120", 1.0),
        ("The answer is 5! = 120.", "120", 1.0),
        ("The answer is 5!", "5", 1.0),
        ("\\boxed{5!}", "5", 0.0),
        # markdown emphasis around the stated answer
        ("The answer is **42**.", "42", 1.0),
        ("**Answer: 42**", "42", 1.0),
        ("**Final Answer:** **$\\frac{1}{2}$**", "0.5", 1.0),
        ("The answer is **41**.", "42", 0.0),
        ("After checking each option, the correct answer is (B).", "B", 1.0),
        ("The correct answer is B.", "B", 1.0),
        ("The correct answer is (B).", "C", 0.0),
        ("The answer is no. It cannot be done.", "no", 1.0),
        # display math after a marker
        ("the answer is:\n\\[\n42\n\\]", "42", 1.0),
        ("The answer is:\n$$\n\\frac{1}{2}\n$$\nDone.", "0.5", 1.0),
        ("The answer is \\[ 42 \\]", "42", 1.0),
        ("The answer is \\[ 41 \\]", "42", 0.0),
        # a stated chain of arithmetic states its last side; an equation stays whole
        ("So the answer is 6 \\times 7 = 42.", "42", 1.0),
        ("So the answer is $6 \\times 7 = 41$.", "42", 0.0),
        ("The answer is $x + y = 5$.", "x + y = 5", 1.0),
        ("The answer is $x + y = 5$.", "5", 0.0),
        # GSM8K's "#### 42" line is a stated answer, later than a marker in the reasoning
        ("Let me check that the answer is reasonable: 6*7=42.\n#### 42", "42", 1.0),
        ("To find the answer: multiply 6 by 7.\n6 * 7 = 42\n#### 42", "42", 1.0),
        ("The answer is 5.\n#### Verification\n5 * 1 = 5", "5", 1.0),  # a heading is not one
        ("So 12 apples.\n#### 1,234", "1234", 1.0),
        # a verdict on the answer is not a stated answer
        ("The answer is 42. Let me check that the answer is correct.", "42", 1.0),
        ("The answer is 41. Checking, the answer is not correct.", "42", 0.0),
        # several answers at once still score 0
        ("The answer is $1$ or $2$.", "1", 0.0),
        ("The answer is $1$ or $2$.", "2", 0.0),
        ("The answer is 1 or 2", "1", 0.0),
        ("The answer is $1$, $2$.", "1", 0.0),
        ("\\boxed{1} \\boxed{2}", "1", 0.0),
    ],
)
def test_stated_answers_in_common_formats(text, gt, score):
    assert math_answer(text, ground_truth=gt).score == score


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        ("So x = \u22123", "-3", 1.0),  # the Unicode minus sign keeps its sign
        ("So x = \u22123", "3", 0.0),
        ("#### \u221212", "-12", 1.0),
        ("The temperature drops to \u22125 degrees", "-5", 1.0),
        ("So it comes to 1.5\u00d710\u00b3", "1500", 1.0),
        ("so the area is \u00bd", "0.5", 1.0),
        ("The answer is 2\u00b73\u00b77.", "42", 1.0),  # the middle dot was unparsable
        ("The answer is 2\u00b73\u00b77.", "237", 0.0),
    ],
)
def test_an_answer_in_unicode_math_is_read_whole(text, gt, score):
    # extraction looked for ASCII signs only: "x = \u22123" read 3 (0 against -3, 1 against 3),
    # "1.5\u00d710\u00b3" read 10, and "\u00bd" read nothing
    assert math_answer(text, ground_truth=gt).score == score


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a product or a quotient of numbers at the end of the prose is one expression: the
        # fallback read its last factor (3 of "2 \\times 3")
        ("so 2 \\times 3 apples", "2 \\times 3"),
        ("In total 6 * 7 ways.", "6 * 7"),
        ("so 2 \\cdot 3 \\cdot 7", "2 \\cdot 3 \\cdot 7"),
        ("each gets 12 / 4", "12 / 4"),
        ("each gets 12 \\div 4.", "12 \\div 4"),
        ("so the total is 2 \\times 1,000.", "2 \\times 1,000"),
        ("so 2 \\times 3 \\times 10^8", "2 \\times 3 \\times 10^8"),
        # the number after the last "=" wins, as before
        ("So 3 \\times 4 = 12", "12"),
        ("So 3 \\times 4 = 12.", "12"),
        ("so 12 = 3 \\times 4", "3 \\times 4"),
        # no operator between the numbers, or one across a line, is no product
        ("the sides are 3 and 4", "4"),
        ("we get 3\n* 4", "4"),
        ("1 \\cdot 2 \\cdots 10", "10"),
        # a premise's bound is still a premise's, product or not
        ("He needs 4 more boxes since 4 * 3 > 10.", "4"),
    ],
)
def test_a_product_of_numbers_is_read_whole(text, expected):
    assert extract_final(text) == (expected, "last_number")


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        ("The product is 2\u00b73.", "6", 1.0),
        ("The product is 2\u00b73.", "3", 0.0),
        ("So the area is 2 \u00d7 3", "6", 1.0),
        ("So the area is 2 \u00d7 3", "3", 0.0),
        ("Each friend gets 12 \u00f7 4.", "3", 1.0),
        ("Each friend gets 12 \u00f7 4.", "4", 0.0),
        ("So 3 \u00d7 4 = 12", "12", 1.0),
        ("So 3 \u00d7 4 = 12", "4", 0.0),
        ("so the total is 2 \\times 1,000.", "2000", 1.0),
        ("so the total is 2 \\times 1,000.", "1000", 0.0),
    ],
)
def test_a_product_of_numbers_is_scored_whole(text, gt, score):
    # "The product is 2\u00b73." read 3: a miss against 6, and 1.0 against 3
    assert math_answer(text, ground_truth=gt).score == score, math_answer(text, ground_truth=gt).info


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a percent sign stays with its number: "1,000%" read 1,000, and the percentage rule
        # never saw the sign
        ("so it is 1,000%.", "1,000%"),
        ("The probability is 50 %.", "50 %"),
        ("so it is 12.5\\%.", "12.5\\%"),
        ("It grew by 12.5 percent.", "12.5 percent"),
        ("It grew by 12.5 percentage points.", "12.5"),  # a word that is not "percent"
        ("so it is 2 \\times 50%", "2 \\times 50%"),
    ],
)
def test_a_percent_sign_stays_with_its_number(text, expected):
    assert extract_final(text) == (expected, "last_number")


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        ("so it is 1,000%.", "10.0", 1.0),
        ("so it is 1,000%.", "10", 0.0),  # against an integer: 1000
        ("so it is 1,000%.", "1000", 1.0),
        ("The probability is 50%.", "\\frac{1}{2}", 1.0),
        ("The probability is 50%.", "0.05", 0.0),
        ("The probability is 50%.", "50", 1.0),
        ("It grew by 12.5 percent.", "0.125", 1.0),
        ("It grew by 12.5 percent.", "0.0125", 0.0),
    ],
)
def test_a_percent_sign_stays_with_its_number_scored(text, gt, score):
    assert math_answer(text, ground_truth=gt).score == score, math_answer(text, ground_truth=gt).info


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        ("So the side is \u221a2.", "\\sqrt{2}", 1.0),
        ("So the side is \u221a2.", "2", 0.0),
        ("so x = \u221a(2)", "\\sqrt{2}", 1.0),
        ("so x = 3\u221a(2), done", "\\sqrt{18}", 1.0),
        ("so x = 3\u221a(2), done", "2", 0.0),
        ("so it is \\sqrt{5}.", "\\sqrt{5}", 1.0),
        ("The answer is \u221a(x+1).", "\\sqrt{x+1}", 1.0),
        ("The answer is \u221a(x+1).", "\\sqrt{x}+1", 0.0),
    ],
)
def test_a_root_is_read_whole(text, gt, score):
    # the last-number fallback read the radicand alone: "\u221a2" read 2 (a miss against
    # \\sqrt{2}, and 1.0 against 2); "\u221a(x+1)" was \\sqrt (x+1), unparsable
    assert math_answer(text, ground_truth=gt).score == score, math_answer(text, ground_truth=gt).info


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        # the whole first sentence was the answer: a reason after it made it unparsable
        ("The answer is 42, because 6 times 7 is 42.", "42", 1.0),
        ("The answer is 42, which is the product.", "42", 1.0),
        ("So the answer is 42; this matches the check.", "42", 1.0),
        ("Therefore, the final answer is 42 (six times seven).", "42", 1.0),
        ("The answer is 42 since 6 \\times 7 = 42.", "42", 1.0),
        ("The answer is $42$, since $6 \\times 7 = 42$.", "42", 1.0),
        ("Answer: 42 dollars, after tax", "42", 1.0),
        ("The answer is 41, because 6 times 7 is 42.", "42", 0.0),
        ("The answer is 41 since 6 \\times 7 = 42.", "42", 0.0),
        # a clause about the writer after a comma: the cut left the comma ("18,": unparsable)
        ("The answer is 18, and that's the number of apples.", "18", 1.0),
        ("The answer is 18, and I am confident.", "18", 1.0),
        # lists, points and a second answer stay whole
        ("The answer is 1, 2, 3.", "\\{1,2,3\\}", 1.0),
        ("The answer is 1, 2, which are the roots.", "\\{1,2\\}", 1.0),
        ("The answer is (1, 2), since the line passes there.", "(1,2)", 1.0),
        ("The answer is $x = 1, y = 2$, so the point is found.", "(1,2)", 1.0),
        ("The answer is 42 (or 43).", "42", 0.0),
        ("The answer is 42, or 43.", "42", 0.0),
    ],
)
def test_a_stated_answer_ends_where_a_clause_or_an_aside_starts(text, gt, score):
    assert math_answer(text, ground_truth=gt).score == score, math_answer(text, ground_truth=gt).info


THOUGHT_41 = "<think>Maybe \\boxed{41}? Let me recheck: 6*7 = 42.</think>\nThe answer is 42."


STATED_41 = "<think>So the answer is 41. Hmm, no, 6*7=42.</think>\n42"


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        # an answer weighed while thinking was read before the one given after </think>
        (THOUGHT_41, "42", 1.0),
        (THOUGHT_41, "41", 0.0),
        (STATED_41, "42", 1.0),
        (STATED_41, "41", 0.0),
        ("<think>\\boxed{1}</think><think>\\boxed{2}</think> so \\boxed{3}", "3", 1.0),  # the last one
        # the last box or stated answer, whichever is later (a box always won)
        ("First guess \\boxed{41}. Wait, that is wrong; recomputing, the final answer is 42.", "41", 0.0),
        ("First guess \\boxed{41}. Wait, that is wrong; recomputing, the final answer is 42.", "42", 1.0),
        ("Answer: 41? No: \\boxed{42}", "42", 1.0),
        ("The answer is \\boxed{42}.", "42", 1.0),
        ("\\boxed{\\text{the answer is 42}}", "42", 0.0),  # a marker inside the box is the box's
        ("\\boxed{42}. Let me check that the answer is correct.", "42", 1.0),  # a verdict, not an answer
    ],
)
def test_the_answer_is_read_after_the_thinking_and_the_later_of_box_and_marker(text, gt, score):
    assert math_answer(text, ground_truth=gt).score == score


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        # the outermost of nested boxes is the answer as written; the inner box alone was read:
        # 3 of \\boxed{2 + \\boxed{3}}, and 2 of \\boxed{\\frac{1}{\\boxed{2}}}
        ("\\boxed{2 + \\boxed{3}}", "5", 1.0),
        ("\\boxed{2 + \\boxed{3}}", "3", 0.0),
        ("Thus \\boxed{\\frac{1}{\\boxed{2}}}.", "\\frac{1}{2}", 1.0),
        ("Thus \\boxed{\\frac{1}{\\boxed{2}}}.", "2", 0.0),
        ("So \\boxed{x = \\boxed{5}}.", "5", 1.0),
        ("\\boxed{\\boxed{5}}", "5", 1.0),
    ],
)
def test_nested_boxes_read_as_the_outermost(text, gt, score):
    assert math_answer(text, ground_truth=gt).score == score


PIECEWISE = "\\left\\{\\begin{array}{ll} x & x \\ge 0 \\\\ -x & x < 0 \\end{array}\\right."


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        # an escaped brace is a character: \\left\\{ never closed the box, and the fallback
        # read 0 of "x < 0"; a lone \\} closed it early (\\lbrace 1, 2 \\ was unparsable)
        (f"so \\boxed{{f(x) = {PIECEWISE}}}", PIECEWISE, 1.0),
        (f"so \\boxed{{f(x) = {PIECEWISE}}}", "0", 0.0),
        (f"so \\boxed{{f(x) = {PIECEWISE}}}", "x", 0.0),
        ("The solutions are \\boxed{\\lbrace 1, 2 \\}}.", "\\{1, 2\\}", 1.0),
        ("The solutions are \\boxed{\\lbrace 1, 2 \\}}.", "\\{1, 3\\}", 0.0),
        ("The solutions are \\boxed{\\{1, 2\\}}.", "\\{2, 1\\}", 1.0),
        ("The solutions are \\boxed{\\{1, 2\\}}.", "\\{1, 3\\}", 0.0),
    ],
)
def test_escaped_braces_do_not_count_in_a_box(text, gt, score):
    assert math_answer(text, ground_truth=gt).score == score


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        # a denied candidate with no answer stated before it: the denial was skipped and the
        # last number (or math) read, which is the very candidate the text rejects
        ("The answer is not 7.", "7", 0.0),
        ("The final answer is not $\\frac{1}{2}$.", "\\frac{1}{2}", 0.0),
        ("The answer is definitely not 7.", "7", 0.0),
        # ... and a box the text then rejects is not its answer either
        ("At first \\boxed{5}. Checking again, the answer is not 5.", "5", 0.0),
        ("At first \\boxed{5}. Checking again, the answer is not $5$.", "5", 0.0),
        # ... but an answer after the rejected candidate is read as before (the fallback, from
        # there on): a self-correction need not say "the answer is" again
        ("The answer is not 5, it is 6.", "6", 1.0),
        ("Wait, the answer is not 5. Recomputing: 2 \\times 3 = 6.", "6", 1.0),
        ("At first \\boxed{5}. Hmm, the answer is not 5. Redoing it gives 6.", "6", 1.0),
        ("At first \\boxed{5}. Hmm, the answer is not 5. Redoing it gives 6.", "5", 0.0),
        # a denial of another candidate leaves the box, or the answer stated before it
        ("So \\boxed{7}. Note that the answer is not 5.", "7", 1.0),
        ("The answer is 7. Note that the answer is not 5.", "7", 1.0),
        # a correction in the denial's sentence is its answer (the candidate ran to the
        # sentence's end, "5 but 6", and nothing was read after it)
        ("The answer is not 5 but 6.", "6", 1.0),
        ("The answer is not $\\frac{1}{2}$ but rather $\\frac{1}{3}$.", "\\frac{1}{3}", 1.0),
        # an answer that refers back states nothing: the earlier one, or the last number
        ("The answer is 42. Checking: 6 * 7 = 42, so the answer is the same as before.", "42", 1.0),
        ("x = 6 * 7 = 42.\nThe answer is the same as above.", "42", 1.0),
    ],
)
def test_a_rejected_candidate_is_not_the_answer(text, gt, score):
    assert math_answer(text, ground_truth=gt).score == score, math_answer(text, ground_truth=gt).info


@pytest.mark.parametrize(
    "text",
    [
        "the answer is not 5 but it is close",  # a denial: no answer (so it was already)
        # a denial the marker does not read ("isn't", "cannot be") or a text with no marker:
        # the fallback read the last number, the very one the text negates
        "The answer isn't 5 but it is close.",
        "The answer isn\u2019t 5 but it is close.",
        "The answer cannot be 5, but it is close.",
        "The answer can't be 5 but it is close.",
        "The answer would not be 5 but it is close.",
        "It is not 5 but it is close.",
        "x is not $5$, but it is close.",
        "#### not 5 but it is close",
        # "not x" was read as a name, and "not x = 5" as its value 5
        "The answer is not x = 5 but it is close.",
        # a later denial of the answer stated before it withdraws it (as it does a box)
        "The answer is 5. Wait, the answer is not 5 but it is close.",
        "The answer is $5$. Hmm, the answer is not 5, but it is close.",
        "\\boxed{5}. Hmm, the answer is not 5 but it is close.",
    ],
)
def test_a_negated_statement_is_not_read_as_the_answer_it_negates(text):
    res = math_answer(text, ground_truth="5")
    assert res.score == 0.0, res.info


@pytest.mark.parametrize(
    ("text", "gt"),
    [
        # the number negated is passed over, not every number: the one before it is read
        ("So x = 3, and not 5.", "3"),
        ("It is not 5; it is 6.", "6"),
        ("Since $n$ is not 0, there are 12 ways.", "12"),
        ("The answer can't be 5, so it is 6.", "6"),
        # a denial of another value leaves the answer stated before it
        ("The answer is 5. Wait, the answer is not 6.", "5"),
        ("The answer is 5. Note that it is not 6.", "5"),
        ("The answer is not 5 but 6.", "6"),
    ],
)
def test_a_negation_of_another_value_leaves_the_answer(text, gt):
    res = math_answer(text, ground_truth=gt)
    assert res.score == 1.0, res.info


@pytest.mark.parametrize("text", ["<think>so \\boxed{42}</think>", "<think>The answer is 42.</think>\n \n"])
def test_nothing_after_the_thinking_is_no_answer(text):
    assert extract_final(text) == (None, "none")
    res = math_answer(text, ground_truth="42")
    assert res.score == 0.0 and res.info["decided_by"] == "no_answer"
