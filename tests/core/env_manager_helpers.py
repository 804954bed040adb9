"""What test_env_manager.py and test_env_manager_turns.py share: environments and a job
config, the scripted proxy and tool bridge, and the mark that runs a module's tests on one
event loop (its pool's; the fixtures are in env_manager_fixtures.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from core.config import EnvConfig, JobConfig
from core.rollout.engines.base import Completion, GenerateRequest

LAKE = {"id": "frozenlake-v1", "tag": "lake", "max_turns": 4, "kwargs": {"desc": ["SF", "FG"]}}
"""S F / F G: ``right`` then ``down`` reaches the goal; ``left`` bumps into the edge."""
MATH = {"id": "math-tools-v1", "tag": "math", "max_turns": 3}
CALL = json.dumps({"tool": "calculator", "arguments": {"expression": "6 * 7"}})

ABORT = object()
HANG = object()
Reply = str | BaseException | object


def job(*envs: dict[str, Any], timeout_s: float = 60.0) -> JobConfig:
    envs = tuple(e.model_dump() if isinstance(e, EnvConfig) else e for e in envs)
    tags = {e["tag"] for e in envs}
    return JobConfig.from_dict(
        {
            "envs": list(envs),
            "rewards": {t: [{"function": "unused"}] for t in tags},
            "engine": {"max_new_tokens": 4, "temperature": 0.7},
            "rollout": {"trajectory_timeout_s": timeout_s},
        },
        check_references=False,
    )


def env(base: dict[str, Any], **over: Any) -> EnvConfig:
    return EnvConfig.model_validate({**base, **over})


class ScriptedProxy:
    """Replies by turn (a list) or by ``(traj_id, turn)`` (a function): a string is the
    completion's text, ``ABORT`` an aborted turn, ``HANG`` a turn that never ends, an
    exception is raised. Records every request, abort and release."""

    def __init__(self, script: list[Reply] | Callable[[str, int], Reply], version: int = 5):
        self.script = script
        self.version = version
        self.calls: list[tuple[str, str, GenerateRequest]] = []
        self.released: list[str] = []
        self.aborted: list[str] = []

    async def generate(self, traj_id: str, tag: str, request: GenerateRequest) -> Completion:
        self.calls.append((traj_id, tag, request))
        turn = request.metadata["turn"]
        reply = self.script(traj_id, turn) if callable(self.script) else self.script[turn]
        await asyncio.sleep(0)
        if reply is HANG:
            await asyncio.sleep(60)
        if isinstance(reply, BaseException):
            raise reply
        aborted = reply is ABORT
        return Completion(
            request_id=request.request_id,
            text="" if aborted else str(reply),
            prompt_ids=[1, 2],
            token_ids=[] if aborted else [3, 4],
            logprobs=[] if aborted else [-0.1, -0.2],
            policy_version=self.version,
            finish_reason="abort" if aborted else "stop",
            allowed_token_ids=request.allowed_token_ids,
            metadata=request.metadata,
        )

    async def abort(self, traj_id: str) -> int:
        self.aborted.append(traj_id)
        return 0

    async def release(self, traj_id: str) -> None:
        self.released.append(traj_id)


class Tools:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, name: str, arguments: dict[str, Any]) -> str:
        self.calls.append((name, arguments))
        return "42"


# one pool (and event loop) for the module: its zygote starts once, containers stay warm
module_loop = pytest.mark.asyncio(loop_scope="module")


def assistant_turns(traj) -> int:
    return sum(m.role == "assistant" for m in traj.messages)


def check_turn_info(traj) -> None:
    n = assistant_turns(traj)
    assert len(traj.info["turn_rewards"]) == n and len(traj.info["turn_states"]) == n
