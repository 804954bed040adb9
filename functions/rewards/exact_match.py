"""``exact_match``: 1.0 when the final answer equals the ground truth after normalisation."""

from __future__ import annotations

import fabric
from fabric.protocol import Trajectory
from functions.rewards.answer import MAX_ANSWER_CHARS, extract_answer, normalize

_EXAMPLE_TRAJ = {
    "messages": [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "6 * 7 = 42, so the answer is \\boxed{42}.", "policy_version": 0},
    ]
}


@fabric.reward(
    warm=1,
    timeout_s=5,
    max_batch=64,
    examples=(
        {"traj": _EXAMPLE_TRAJ, "ground_truth": "42"},
        {"traj": "The answer is: Paris.", "ground_truth": "paris"},
    ),
)
def exact_match(traj: Trajectory | str, *, ground_truth: str) -> float:
    """Normalised string match of the final answer, read after the last ``</think>`` (nothing
    there: no answer): the last box or the first sentence after the last "the answer is" /
    "Answer:" up to a clause after it ("Paris, the capital."), whichever comes later, else the
    last line; an answer over ``MAX_ANSWER_CHARS``
    characters matches nothing. A negated statement never scores the value it denies ("the
    answer is not Paris", "the answer isn't Paris", "I don't think the answer is Paris",
    "Paris? No"), and a correction after it is the answer ("..., it is London", "... . It is
    London.", "but London", "rather London", "No, it is London"); with nothing that corrects
    it, "the answer is not X" reads as it says, so an honest negation ("not applicable",
    "cannot be determined") matches itself (see ``answer.stated_answer``). A ground truth that
    normalises to nothing ("", "the a") is a ``ValueError``: an empty answer would match it."""
    expected = normalize(ground_truth)
    if not expected:  # "" or "the a": an empty answer (\boxed{}, no text) would score 1.0
        raise ValueError(f"ground_truth {ground_truth!r} is empty once normalised; give the answer itself")
    text = traj if isinstance(traj, str) else traj.final_text()
    answer = extract_answer(text)
    if len(answer) > MAX_ANSWER_CHARS:
        return 0.0
    return 1.0 if normalize(answer) == expected else 0.0
