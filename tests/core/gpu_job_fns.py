"""The reward the GPU job test scores with (top level, importable: the local backend's worker
processes import it by module name, as ``job_faults_fns``)."""

from __future__ import annotations

from fabric.protocol import Trajectory
from fabric.registry import Registry

REG = Registry()


@REG.reward(warm=1)
def vowel_share(traj: Trajectory) -> float:
    """The share of vowels in the policy's replies. Any policy's samples differ in it, a tiny
    random one's too, so every group has advantages and every step changes the weights: what
    the test needs to tell engines that serve the trainer's weights from engines that do not."""
    text = "".join(m.content or "" for m in traj.messages if m.role == "assistant").lower()
    return sum(c in "aeiou" for c in text) / max(len(text), 1)
