"""The framework adapters never give a ``Misconfigured`` call (the function's setup is wrong:
a judge's key refused), nor one whose setup failed otherwise (``SetupFailed``, ``Unauthorized``,
...), the ``failure_score`` or TRL's ``None``: every sample would fail alike,
and the trainer would learn a constant or nothing. The batch raises ``RewardCallError`` saying
what to fix; a failure of one sample's own is still scored."""

from __future__ import annotations

import pytest
from integ_fns import REG
from integ_helpers import call_trl, fake_backend, trl_kwargs

from fabric.errors import ErrorCode
from fabric.integrations import RewardCallError
from fabric.integrations.openrlhf import OpenRLHFReward
from fabric.integrations.trl import trl_reward
from fabric.integrations.verl import VerlReward
from fabric.testing import Fault

fake = pytest.fixture(fake_backend, name="fake")

SET_THE_KEY = Fault(code=ErrorCode.MISCONFIGURED, message="HTTP 401; check the API key (MY_KEY)")


@pytest.mark.parametrize("options", [{}, {"failure_score": -1.0}])
def test_trl_raises_for_a_misconfigured_function_whatever_failure_score(fake, options):
    fake.inject("explode", SET_THE_KEY)
    with trl_reward("explode", registry=REG, backend_instance=fake, **options) as reward:
        with pytest.raises(RewardCallError) as e:
            call_trl(reward, ["p", "p"], ["fine", "fine"], **trl_kwargs(2, ground_truth=["g", "g"]))
    text = str(e.value)
    assert "Misconfigured: HTTP 401; check the API key (MY_KEY)" in text
    assert "its setup is wrong" in text


def test_verl_and_openrlhf_raise_with_failure_score_set(fake):
    fake.inject("explode", SET_THE_KEY)
    v = VerlReward("explode", registry=REG, backend_instance=fake, failure_score=0.0)
    try:
        with pytest.raises(RewardCallError, match="check the API key"):
            v.compute_score("d", "fine", "g", {})
    finally:
        v.close()
    fake.inject("explode", SET_THE_KEY)
    with OpenRLHFReward("explode", registry=REG, backend_instance=fake, failure_score=0.0) as reward_func:
        with pytest.raises(RewardCallError, match="check the API key"):
            reward_func(["p a", "p b"], ["p", "p"], ["g", "g"])


def test_a_samples_own_failure_is_still_failure_scored(fake):
    with trl_reward("explode", registry=REG, backend_instance=fake, failure_score=-1.0) as reward:
        out, _ = call_trl(reward, ["p"] * 2, ["boom", "ok"], **trl_kwargs(2, ground_truth=["g"] * 2))
    assert out == [-1.0, 1.0]


def test_a_module_of_no_functions_is_warned_of(tmp_path):
    """``modules`` naming one whose functions lack their decorator was silent (the CLI's -m
    warned): the reward then failed with "unknown function" and no word of the module."""
    from fabric.integrations.base import RewardAdapter
    from fabric.integrations.config import IntegrationConfig
    from fabric.registry import NoFunctionsWarning, Registry

    mine = tmp_path / "undecorated_integ_fns.py"
    mine.write_text("def my_reward(traj: str) -> float:\n    return 1.0\n")
    config = IntegrationConfig.parse({"function": "exact_match", "modules": [str(mine)]}, env={})
    with pytest.warns(NoFunctionsWarning, match=f"{str(mine)!r} defines no fabric function: decorate"):
        RewardAdapter(config, registry=Registry())


@pytest.mark.parametrize(
    "code",
    [ErrorCode.SETUP_FAILED, ErrorCode.UNAUTHORIZED, ErrorCode.UNKNOWN_FUNCTION, ErrorCode.VERSION_MISMATCH],
)
@pytest.mark.parametrize("options", [{}, {"failure_score": -1.0}])
def test_a_setup_wide_failure_raises_like_misconfigured(fake, code, options):
    # a setup hook that raises (SetupFailed: no worker can serve), a token the fabric serve
    # refuses, a function it does not serve, other code deployed: every sample fails alike,
    # and TRL trained on None for all (one WARNING a batch) or on the failure_score
    fake.inject("explode", *(Fault(code=code, message="cannot serve") for _ in range(2)))
    with trl_reward("explode", registry=REG, backend_instance=fake, **options) as reward:
        with pytest.raises(RewardCallError) as e:
            call_trl(reward, ["p", "p"], ["fine", "fine"], **trl_kwargs(2, ground_truth=["g", "g"]))
    assert f"{code}: cannot serve" in str(e.value) and "no failure_score stands in" in str(e.value)
