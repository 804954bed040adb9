"""What the ``fabric.integrations`` test modules (``test_integrations_*.py``) share: the
local backend of one worker, the message lists and keyword arguments TRL's GRPOTrainer
passes, a caller that takes the trainer's metrics apart, and the ``FakeBackend`` over
``integ_fns.REG`` each module binds as its ``fake`` fixture."""

from __future__ import annotations

from integ_fns import REG

from fabric.testing import FakeBackend

LOCAL1 = {"type": "local", "max_workers": 1}


def msgs(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def trl_kwargs(n: int, **columns: list) -> dict:
    """What GRPOTrainer._calculate_rewards adds to every call besides the dataset columns."""
    metrics: list[tuple[str, float]] = []
    return {
        "completion_ids": [[5, 6, 7]] * n,
        "trainer_state": object(),
        "log_extra": lambda column, values: None,
        "log_metric": lambda name, value: metrics.append((name, value)),
        **columns,
        "_metrics": metrics,
    }


def call_trl(reward, prompts, completions, **kw):
    kw = dict(kw)
    metrics = kw.pop("_metrics", None)
    out = reward(prompts=prompts, completions=completions, **kw)
    return out, metrics


def fake_backend() -> FakeBackend:
    return FakeBackend(REG)
