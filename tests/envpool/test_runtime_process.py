"""The process runtime's own bookkeeping, with real containers: what it kills (never a pid
the kernel may have given to another process), what a cancelled start leaves behind, and
a container's output once it is ready (zygote or not)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from echo_bundle import IMAGE, DirImages
from pool_util import alive

from envpool.pool import EnvPool


def _bundle(root: Path, source: str, module: str, env_id: str, entry: str) -> DirImages:
    root.mkdir(parents=True)
    (root / f"{module}.py").write_text(source)
    manifest = {"register": [{"id": env_id, "entry_point": f"{module}:{entry}"}]}
    (root / "envpool.json").write_text(json.dumps(manifest))
    return DirImages(root)


# -- what a container prints ------------------------------------------------------------------

_PRINTER = '''
import envpool


class PrintEnv(envpool.Env):
    """Prints 100 kB of debug output per step."""

    example_actions = ("a",)

    def reset(self, *, seed=None, options=None):
        self.n = 0
        return "ready", {}

    def step(self, action):
        self.n += 1
        print("debug output\\n" * 8000, end="", flush=True)
        return envpool.StepResult(obs=envpool.Observation(text=str(self.n)))
'''


async def test_an_environment_that_prints_runs_on_without_the_zygote(tmp_path):
    # a fresh interpreter's stdout was the pipe its ready line came through, never read
    # again: ~200 kB of prints filled it and the step hung (EnvHung), then stopping the
    # container waited on that pipe for stop_timeout_s
    images = _bundle(tmp_path / "b", _PRINTER, "print_env", "print-v0", "PrintEnv")
    runtime = {"heartbeat_s": 0.1, "zygote": False}
    cfg = {"min_warm": 0, "step_timeout_s": 3.0, "stop_timeout_s": 3.0, "runtime": runtime}
    p = EnvPool(cfg, images=images)
    async with p:
        async with p.session("print-v0", image=IMAGE) as s:
            await s.reset(seed=0)
            for n in range(1, 5):
                assert (await s.step("a")).obs.text == str(n)
            pid = s.container.pid
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 2.0  # the close did not wait on the pipe
    assert not p.runtime.live and not alive(pid)
