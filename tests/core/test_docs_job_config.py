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
