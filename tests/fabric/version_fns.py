"""One function name with two codes, in two registries: ``OLD`` stands for what a deployment
made before an edit serves (a Lambda not redeployed, a ``fabric serve`` not restarted), ``NEW``
for what the caller registered since. Top level: local workers import them."""

from __future__ import annotations

from fabric.registry import Registry

OLD = Registry()
NEW = Registry()
RUNS: list[str] = []
"""Executions in this process (the inproc backend's), in order."""


@OLD.function(name="scale", warm=0)
def scale_old(x: int) -> int:
    RUNS.append("old")
    return x * 2


@NEW.function(name="scale", warm=0)
def scale_new(x: int) -> int:
    RUNS.append("new")
    return x * 3


@OLD.tool(name="send", warm=0, side_effects=True)
def send_old(x: int) -> int:
    RUNS.append("send-old")
    return x


@NEW.tool(name="send", warm=0, side_effects=True)
def send_new(x: int) -> int:
    RUNS.append("send-new")
    return x
