"""A bad ``EnvPool({...})`` config: each problem named by its key, an unknown key with the
closest allowed one and the list of them, raised as an envpool error (a ``ValueError``, as
pydantic's was) rather than pydantic's "Extra inputs are not permitted"."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from envpool.errors import EnvPoolError, PoolConfigError
from envpool.pool import EnvPool, PoolConfig


def _refusal(config: dict) -> PoolConfigError:
    with pytest.raises(PoolConfigError) as e:
        EnvPool(config)
    assert not isinstance(e.value, ValidationError)
    return e.value


def test_an_unknown_key_suggests_the_near_one_and_lists_the_allowed():
    """It raised pydantic's text: "min_wram / Extra inputs are not permitted [type=extra_forbidden,
    input_value=2, input_type=int] / For further information visit https://errors.pydantic.dev/..."."""
    said = str(_refusal({"min_wram": 2}))
    assert said.startswith("bad EnvPool config: min_wram: unknown key (did you mean 'min_warm'?); allowed: ")
    assert "max_containers" in said and "step_timeout_s" in said
    assert "Extra inputs" not in said and "pydantic" not in said and "\n" not in said


@pytest.mark.parametrize(
    ("config", "said"),
    [
        (
            {"retry": {"atempts": 3}},
            "retry.atempts: unknown key (did you mean 'attempts'?); allowed: attempts",
        ),
        # a runtime's keys are written as the dict reads them (not runtime.process.heartbeat_sz)
        ({"runtime": {"heartbeat_sz": 1}}, "runtime.heartbeat_sz: unknown key (did you mean 'heartbeat_s'?)"),
        (
            {"runtime": {"type": "docker", "networc": "host"}},
            "runtime.networc: unknown key (did you mean 'network'?)",
        ),
        (
            {"runtime": {"type": "dokcer"}},
            "runtime.type: unknown type 'dokcer' (did you mean 'docker'?); known: process, kubernetes",
        ),
        ({"min_warm": -1}, "min_warm: must be >= 0 (got -1)"),
        ({"min_warm": 3, "max_containers": 2}, "min_warm (3) is more than max_containers (2)"),
    ],
)
def test_each_problem_is_named_by_its_key(config, said):
    assert said in str(_refusal(config))


def test_the_error_is_caught_as_an_envpool_error_and_as_a_value_error():
    # callers that caught pydantic's ValidationError as a ValueError still catch it
    assert issubclass(PoolConfigError, EnvPoolError) and issubclass(PoolConfigError, ValueError)


def test_a_config_object_and_none_are_taken_as_they_were():
    cfg = PoolConfig(min_warm=0)
    assert EnvPool(cfg).config is cfg
    assert EnvPool().config == PoolConfig() == EnvPool({}).config
