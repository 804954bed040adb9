"""docs/job.md's YAML blocks are configs a reader pastes: each one validates, the whole job as
it stands, a fragment merged into the example config it belongs to (the one whose envs carry
its reward tags, the GPU one for a vLLM engine, else FrozenLake's)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.config import JobConfig
from core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "job.md").read_text()
BLOCKS = [yaml.safe_load(b) for b in re.findall(r"^```yaml\n(.*?)^```", DOC, flags=re.S | re.M)]
EXAMPLES = sorted((ROOT / "examples").glob("*/config.yaml"))


def _example(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "examples" / name / "config.yaml").read_text())
    for env in data["envs"]:  # relative to the working directory, which is not the test's
        if "image" in env:
            env["image"] = str(ROOT / env["image"])
    return data


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    for k, v in over.items():
        base[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return base


def _base_for(fragment: dict[str, Any]) -> dict[str, Any]:
    tags = set(fragment.get("rewards", {}))
    if tags:
        homes = [
            p.parent.name for p in EXAMPLES if tags <= {e["tag"] for e in _example(p.parent.name)["envs"]}
        ]
        assert homes, f"docs/job.md: no example config has envs tagged {sorted(tags)} for {fragment}"
        return _example(homes[0])
    if fragment.get("engine", {}).get("backend") == "vllm":
        return _example("gpu")
    return _example("frozenlake")


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_every_yaml_block_of_job_md_validates(i):
    block = BLOCKS[i]
    if "envs" in block:  # the whole job of "Your own environment", beside its coin/ directory
        for env in block["envs"]:
            env["image"] = str(ROOT / "examples" / "own_env" / env["image"])
        JobConfig.from_dict(block, source=f"docs/job.md yaml block {i}")
    else:
        JobConfig.from_dict(_merge(_base_for(block), block), source=f"docs/job.md yaml block {i}")


def _said(holding: str) -> str:
    """The ``error: ...`` block of docs/job.md holding ``holding``, without its prompt line."""
    blocks, block, lang = [], None, ""
    for line in DOC.splitlines(keepends=True):  # fences in order: a closing one opens nothing
        if line.lstrip().startswith("```"):
            if block is None:
                block, lang = [], line.strip()[3:]
            else:
                if not lang and holding in "".join(block):
                    blocks.append("".join(block))
                block = None
        elif block is not None:
            block.append(line)
    assert len(blocks) == 1, f"docs/job.md: {len(blocks)} blocks hold {holding!r}"
    text = blocks[0][blocks[0].index("error: ") :]
    return text.removeprefix("error: ").rstrip("\n")


def test_the_misspelt_env_id_is_refused_as_job_md_shows():
    data = _example("frozenlake")
    data["envs"][0]["id"] = "frozenlak-v1"
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict(data, source="bad.yaml")
    assert str(e.value) == _said("frozenlak-v1")


def test_an_unquoted_ground_truth_is_refused_as_job_md_shows():
    data = _example("own_env")
    data["rewards"] = {"coin": [{"function": "exact_match", "args": {"ground_truth": 5}}]}
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict(data, source="job.yaml")
    assert str(e.value) == _said("quote it in the YAML")
