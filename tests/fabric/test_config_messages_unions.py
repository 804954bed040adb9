"""Config errors inside a tagged union (``runtime: {type: docker, ...}``) are worded like any
other: pydantic puts the member's tag in the path (``runtime.docker.imagee``), a key no config
has, and an unknown key there named no allowed keys; a mistyped tag said only pydantic's
"Input tag 'proces' found using 'type' does not match any of the expected tags"."""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.config import JobConfig
from core.errors import ConfigError
from envpool import EnvPool
from envpool.errors import PoolConfigError
from envpool.pool_config import PoolConfig, parse_pool_config
from fabric.config_messages import allowed_keys, one_line


class _Cat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["cat"] = "cat"
    whiskers: int = 0


class _Dog(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["dog"] = "dog"
    bark: str = "woof"


class _Home(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pets: list[Annotated[_Cat | _Dog, Field(discriminator="kind")]] = []
    best: Annotated[_Cat | _Dog, Field(discriminator="kind")] | None = None


def _said(data: dict) -> str:
    with pytest.raises(ValidationError) as e:
        _Home.model_validate(data)
    return one_line(e.value, _Home)


def test_an_unknown_key_in_a_union_member_is_keyed_as_the_config_reads_it():
    said = _said({"pets": [{"kind": "cat"}, {"kind": "dog", "barks": "x"}]})
    assert said == "pets[1].barks: unknown key (did you mean 'bark'?); allowed: kind, bark"
    said = _said({"best": {"kind": "cat", "whisker": 1}})
    assert said == "best.whisker: unknown key (did you mean 'whiskers'?); allowed: kind, whiskers"


def test_a_bad_value_in_a_union_member_is_keyed_without_the_tag():
    assert _said({"best": {"kind": "cat", "whiskers": "many"}}).startswith("best.whiskers: Input should be")


def test_a_mistyped_tag_names_its_key_the_closest_tag_and_the_known_ones():
    said = _said({"best": {"kind": "dgo"}})
    assert said == "best.kind: unknown kind 'dgo' (did you mean 'dog'?); known: cat, dog"


def test_allowed_keys_follow_the_tag():
    assert allowed_keys(_Home, ("pets", 0, "dog")) == ["kind", "bark"]
    assert allowed_keys(_Home, ("best", "cat")) == ["kind", "whiskers"]


def test_the_jobs_envpool_runtime_keys_are_said_with_the_allowed_ones():
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict(
            {
                "envs": [{"id": "frozenlake-v1", "tag": "lake"}],
                "envpool": {"runtime": {"type": "docker", "imagee": "x"}},
            }
        )
    assert "envpool.runtime.imagee: unknown key (did you mean 'image'?); allowed:" in str(e.value)
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict(
            {"envs": [{"id": "frozenlake-v1", "tag": "lake"}], "envpool": {"runtime": "dokcer"}}
        )
    assert "envpool.runtime.type: unknown type 'dokcer' (did you mean 'docker'?); known: process" in str(
        e.value
    )


@pytest.mark.parametrize("runtime", ["process", "docker"])
def test_envpool_takes_a_runtimes_name_alone_as_a_job_config_does(runtime):
    # EnvPool({"runtime": "process"}) was refused, while a job's `runtime: process` was taken
    cfg = parse_pool_config({"runtime": runtime})
    assert cfg.runtime.type == runtime
    assert PoolConfig.model_validate({"runtime": runtime}).runtime.type == runtime


def test_envpool_refuses_an_unknown_runtime_name_with_the_known_ones():
    with pytest.raises(
        PoolConfigError, match=r"runtime\.type: unknown type 'proces' \(did you mean 'process'\?\)"
    ):
        EnvPool({"runtime": "proces"})
