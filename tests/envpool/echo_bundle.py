"""A trivial environment shipped as an image bundle directory, for pool tests."""

from __future__ import annotations

import json
from pathlib import Path

ENV_SOURCE = '''
import sys
import time
import envpool


class EchoEnv(envpool.Env):
    """Echoes the action; 'boom' raises, 'sleep S' blocks, 'spin S' holds the CPU
    and the interpreter lock, 'tool EXPR' calls the calculator."""

    example_actions = ("hello",)

    def reset(self, *, seed=None, options=None):
        self.n = 0
        return f"ready {seed}", {"seed": seed}

    def step(self, action):
        self.n += 1
        if action == "boom":
            raise ZeroDivisionError("env bug")
        if action.startswith("sleep "):
            time.sleep(float(action.split()[1]))
        if action.startswith("spin "):  # busy on the CPU holding the interpreter lock: no heartbeats
            sys.setswitchinterval(3600)
            end = time.monotonic() + float(action.split()[1])
            while time.monotonic() < end:
                pass
            sys.setswitchinterval(0.005)
        if action.startswith("tool "):
            out = self.call_tool("calculator", {"expression": action[5:]})
            return envpool.StepResult(obs=envpool.Observation(text=out))
        obs = envpool.Observation(text=f"{action} #{self.n}")
        return envpool.StepResult(obs=obs, reward=float(self.n), terminated=action == "done")


class RandomEnv(EchoEnv):
    """Not deterministic: a lost session cannot be replayed."""


class LiarEnv(EchoEnv):
    """Claims to be deterministic but is not: a replay must notice."""

    def reset(self, *, seed=None, options=None):
        import os

        self.n = 0
        return f"ready {os.urandom(4).hex()}", {}


class Opaque:
    """Stands for a numpy scalar or any other value JSON cannot carry."""


class BadResetInfoEnv(EchoEnv):
    """An environment bug: its reset info cannot be serialised (like a numpy.int64)."""

    def reset(self, *, seed=None, options=None):
        self.n = 0
        return f"ready {seed}", {"level": Opaque()}


class TimedInfoEnv(EchoEnv):
    """Deterministic in all the policy sees; its info carries wall-clock timings."""

    def reset(self, *, seed=None, options=None):
        self.n = 0
        return f"ready {seed}", {"started_at": time.time()}

    def step(self, action):
        res = super().step(action)
        res.info["elapsed_s"] = time.time()
        return res


class SlowInitEnv(EchoEnv):
    """Takes longer to construct than the heartbeat window."""

    def __init__(self):
        time.sleep(1.0)
'''

DIGEST = "sha256:" + "e" * 64
IMAGE = f"echo@{DIGEST}"


def write_bundle(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "echo_env.py").write_text(ENV_SOURCE)
    manifest = {
        "register": [
            {"id": "bundle-echo-v0", "entry_point": "echo_env:EchoEnv", "max_episode_steps": 1000},
            {"id": "bundle-random-v0", "entry_point": "echo_env:RandomEnv", "deterministic": False},
            {"id": "bundle-liar-v0", "entry_point": "echo_env:LiarEnv"},
            {"id": "bundle-slow-init-v0", "entry_point": "echo_env:SlowInitEnv"},
            {"id": "bundle-bad-reset-info-v0", "entry_point": "echo_env:BadResetInfoEnv"},
            {"id": "bundle-timed-info-v0", "entry_point": "echo_env:TimedInfoEnv"},
        ]
    }
    (root / "envpool.json").write_text(json.dumps(manifest))
    return root


def write_env_bundle(root: Path, module: str, source: str, envs: dict[str, str]) -> DirImages:
    """A one-off bundle: ``source`` as ``<module>.py``, registering ``envs`` (id -> class
    name), served as ``IMAGE``."""
    root.mkdir(parents=True)
    (root / f"{module}.py").write_text(source)
    entries = [{"id": env_id, "entry_point": f"{module}:{cls}"} for env_id, cls in envs.items()]
    (root / "envpool.json").write_text(json.dumps({"register": entries}))
    return DirImages(root)


class DirImages:
    """An image resolver over one local bundle directory (the pool's ImageResolver)."""

    def __init__(self, root: Path):
        self.root = root
        self.gets = 0

    async def get(self, digest: str) -> Path:
        self.gets += 1
        if digest != DIGEST:
            from envpool.images.errors import ImageNotFound

            raise ImageNotFound(digest, [str(self.root)])
        return self.root
