"""A function registered again under its name with new code (a module edited and reloaded, a
notebook cell run again) through the local backend: its pool of worker processes, which
imported the function when they started, is replaced by one whose workers import the new
code; the runs under way on the old workers finish there, and the old workers are gone once
they have. The re-registration is a real one: a module file rewritten and reloaded."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import os
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import pytest

from fabric.backends.base import LocalConfig
from fabric.backends.local import LocalBackend
from fabric.client import Client
from fabric.errors import ErrorCode
from fabric.protocol import Invocation
from fabric.registry import Registry

_V1 = """
import os
import time
import fabric

@fabric.function(name="{name}", timeout_s=30, max_concurrency=4, warm=1)
def answer(started: str = "", release: str = "") -> dict:
    if started:
        open(started, "w").close()
    t_end = time.monotonic() + 20
    while release and not os.path.exists(release) and time.monotonic() < t_end:
        time.sleep(0.01)  # a run under way until the test lets it end
    return {{"code": "v1", "pid": os.getpid()}}
"""
_V2 = _V1.replace('"v1"', '"v2, rewritten"')
_NAMES = itertools.count(1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


async def _until(predicate, what: str, within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.fixture
def reloadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """A module of one function in a file of its own, and a function that rewrites and
    reloads it (the workers import it from the same directory: sys.path travels to them)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # the workers' imports too
    mod_name = f"local_reloaded_{request.node.name}"
    # a name of its own: the decorator registers it in the default registry too, by entry
    fn_name = f"local_reloaded_{next(_NAMES)}"
    path = tmp_path / f"{mod_name}.py"
    path.write_text(textwrap.dedent(_V1.format(name=fn_name)))
    importlib.invalidate_caches()
    module = importlib.import_module(mod_name)

    def edit() -> None:
        path.write_text(textwrap.dedent(_V2.format(name=fn_name)))
        importlib.invalidate_caches()

    def reload() -> ModuleType:
        edit()
        return importlib.reload(module)

    try:
        yield fn_name, mod_name, reload, edit
    finally:
        sys.modules.pop(mod_name, None)


async def test_a_reregistered_function_runs_its_new_code_in_new_workers(reloadable, tmp_path):
    """The local pool kept the workers that imported the first code: after the function was
    registered again, every call still ran the old code, silently (the client's spec and
    idempotency key were the new version's)."""
    name, mod_name, reload, _ = reloadable
    started, release = tmp_path / "started", tmp_path / "release"
    reg = Registry()
    reg.discover(mod_name)
    async with Client(backend="local", registry=reg) as c:
        first = await c.call(name, {})
        assert first.ok and first.value["code"] == "v1", first.error
        old_pids = set(c.backend.stats()[name]["pids"])
        assert first.value["pid"] in old_pids
        # a run under way on an old worker when the function is registered again
        under_way = asyncio.ensure_future(c.call(name, {"started": str(started), "release": str(release)}))
        await _until(started.exists, "the run to start on an old worker")

        reload()
        reg.discover(mod_name)
        new = await c.call(name, {})
        assert new.ok and new.value["code"] == "v2, rewritten", (new.value, new.error)
        assert new.value["pid"] not in old_pids
        again = await c.call(name, {})
        assert again.ok and again.value["code"] == "v2, rewritten"

        assert not under_way.done()  # the old worker was not stopped under it
        release.touch()
        finished = await under_way
        assert finished.ok and finished.value == {"code": "v1", "pid": first.value["pid"]}, finished.error
        # the old workers are retired once their runs ended: no process left behind
        await _until(lambda: not any(alive(p) for p in old_pids), "the old workers to be gone")
        new_pids = set(c.backend.stats()[name]["pids"])
        assert new.value["pid"] in new_pids and not new_pids & old_pids
    assert not any(alive(p) for p in old_pids | new_pids)


async def test_a_run_on_a_replaced_pool_is_still_known_to_the_backend(reloadable, tmp_path):
    """What the client and fabric serve ask of a call's run (has it settled? its keyed
    deadline moved) reaches the run on a pool replaced meanwhile: asked of the new pool only,
    a run still going on an old worker read as settled, and its slot was given back under it."""
    name, mod_name, reload, _ = reloadable
    started, release = tmp_path / "started", tmp_path / "release"
    reg = Registry()
    reg.discover(mod_name)
    grew: list[int] = []
    async with LocalBackend(reg) as b:
        b.watch_capacity(name, lambda: grew.append(1))
        payload = {"started": str(started), "release": str(release)}
        under_way = b.submit(Invocation(function=name, payload=payload, idempotency_key="k"))
        await _until(started.exists, "the run to start on an old worker")

        reload()
        reg.discover(mod_name)
        new = await b.submit(Invocation(function=name, payload={}))
        assert new.ok and new.value["code"] == "v2, rewritten", new.error
        assert grew, "the capacity watchers were not told of the new pool"

        assert b.extend_deadline(name, "k", time.time() + 60)
        settled = b.settled(name, under_way)
        assert settled is not None and not settled.done(), "a run on the replaced pool read as settled"
        release.touch()
        finished = await under_way
        assert finished.ok and finished.value["code"] == "v1", finished.error
        await asyncio.wait_for(settled, 10)


async def test_calls_at_close_with_a_pool_being_replaced_are_answered_and_leave_no_process(
    reloadable, tmp_path
):
    """A backend closed while a replaced pool still runs a call: the call is answered and
    the old worker is killed with the rest."""
    name, mod_name, reload, _ = reloadable
    started = tmp_path / "started"
    reg = Registry()
    reg.discover(mod_name)
    b = LocalBackend(reg)
    async with b:
        payload = {"started": str(started), "release": str(tmp_path / "never")}
        under_way = b.submit(Invocation(function=name, payload=payload))
        await _until(started.exists, "the run to start on an old worker")
        old_pids = set(b.stats()[name]["pids"])
        reload()
        reg.discover(mod_name)
        assert (await b.submit(Invocation(function=name, payload={}))).ok
        new_pids = set(b.stats()[name]["pids"])
    answer = await asyncio.wait_for(under_way, 10)
    assert not answer.ok and answer.error is not None, answer
    assert not any(alive(p) for p in old_pids | new_pids)


async def test_a_pool_started_after_the_module_file_was_edited_runs_the_registered_code(reloadable):
    """The module file edited on disk and not registered again, before the function's pool
    started (at its first call): its workers imported the edited file, other code than the
    one registered (whose version keys the calls), and were refused as stale; with no other
    worker, the calls failed SetupFailed. The source is kept when the function is
    registered, not when its pool starts, and the workers import that: the registered code
    runs (the stale refusal stays as the backstop: see test_local_snapshot)."""
    name, mod_name, _, edit = reloadable
    reg = Registry()
    reg.discover(mod_name)
    edit()  # and not reloaded
    async with Client(backend=LocalConfig(setup_failure_cooldown_s=60), registry=reg) as c:
        r = await c.call(name, {})
        assert r.ok and r.value["code"] == "v1", (r.value, r.error)
        pids = c.backend.stats()[name]["pids"]
    assert not any(alive(p) for p in pids)


_DIES = """
import os
import time
import fabric

@fabric.function(name="{name}", timeout_s=30, max_concurrency=4, warm=1)
def answer(started: str = "", release: str = "") -> dict:
    if started:
        open(started, "w").close()
    t_end = time.monotonic() + 20
    while release and not os.path.exists(release) and time.monotonic() < t_end:
        time.sleep(0.01)
    if release:
        os._exit(7)  # the worker dies under this run: the calls queued behind it never ran
    return {{"code": "v1", "pid": os.getpid()}}
"""


async def test_calls_queued_on_a_replaced_pool_that_loses_its_workers_are_still_served(reloadable, tmp_path):
    """A replaced pool whose last worker died with calls still queued there (never started)
    started a worker for them, which imported the module as it is now, the new code, and was
    refused as stale: the queued calls failed SetupFailed saying to register the function
    again, which had been done, while the new pool stood ready. They go to the function's
    current pool instead: the old code they were made with is no longer on disk."""
    name, mod_name, reload, _ = reloadable
    started, release = tmp_path / "started", tmp_path / "release"
    (tmp_path / f"{mod_name}.py").write_text(textwrap.dedent(_DIES.format(name=name)))
    importlib.invalidate_caches()
    importlib.reload(sys.modules[mod_name])
    reg = Registry()
    reg.discover(mod_name)
    async with LocalBackend(reg, LocalConfig(max_workers=1)) as b:
        assert (await b.submit(Invocation(function=name, payload={}))).ok  # warm, and timed
        dying = b.submit(
            Invocation(function=name, payload={"started": str(started), "release": str(release)})
        )
        await _until(started.exists, "the run to start on the old worker")
        queued = [b.submit(Invocation(function=name, payload={})) for _ in range(3)]

        reload()
        reg.discover(mod_name)
        new = await b.submit(Invocation(function=name, payload={}))
        assert new.ok and new.value["code"] == "v2, rewritten", new.error

        release.touch()  # the old pool's only worker dies
        lost = await asyncio.wait_for(dying, 15)
        assert not lost.ok and lost.error is not None and lost.error.type == ErrorCode.WORKER_LOST, lost
        for r in await asyncio.wait_for(asyncio.gather(*queued), 15):
            assert r.ok, r.error
            assert r.value["code"] == "v2, rewritten", r.value


async def test_a_replaced_pools_idle_workers_stop_without_waiting_for_its_last_run(reloadable, tmp_path):
    """A replaced pool kept its idle workers (each holding what its setup hook loaded: a
    reward model, GPU memory) beside the new pool's, until its last run ended or for
    idle_window_s (60 s): twice the workers while a long run finished. They serve nothing
    more (new calls go to the new pool), so they stop at once; the one running stays."""
    name, mod_name, reload, _ = reloadable
    started, release = tmp_path / "started", tmp_path / "release"
    reg = Registry()
    reg.discover(mod_name)
    async with LocalBackend(reg, LocalConfig(warm=2, max_workers=2)) as b:
        await b.warmup([name])
        old_pids = set(b.stats()[name]["pids"])
        assert len(old_pids) == 2
        payload = {"started": str(started), "release": str(release)}
        under_way = b.submit(Invocation(function=name, payload=payload))
        await _until(started.exists, "the run to start on an old worker")

        reload()
        reg.discover(mod_name)
        new = await b.submit(Invocation(function=name, payload={}))
        assert new.ok and new.value["code"] == "v2, rewritten", new.error
        await _until(lambda: sum(alive(p) for p in old_pids) == 1, "the idle old worker to stop", 5.0)
        assert not under_way.done()
        release.touch()
        finished = await asyncio.wait_for(under_way, 15)
        assert finished.ok and finished.value["code"] == "v1", finished.error
        await _until(lambda: not any(alive(p) for p in old_pids), "the old workers to be gone")


async def test_stats_count_the_workers_of_a_replaced_pool_until_they_stop(reloadable, tmp_path):
    """stats() (and fabric serve's fabric_pool_* metrics, read from it) showed the new pool
    only: the old workers still running calls after the function was registered again were
    processes nobody saw. They are counted apart (retiring_workers, retiring_pids) until
    they stop."""
    name, mod_name, reload, _ = reloadable
    started, release = tmp_path / "started", tmp_path / "release"
    reg = Registry()
    reg.discover(mod_name)
    async with LocalBackend(reg) as b:
        under_way = b.submit(
            Invocation(function=name, payload={"started": str(started), "release": str(release)})
        )
        await _until(started.exists, "the run to start on an old worker")
        old_pids = set(b.stats()[name]["pids"])
        assert b.stats()[name]["retiring_workers"] == 0
        reload()
        reg.discover(mod_name)
        assert (await b.submit(Invocation(function=name, payload={}))).ok
        stats = b.stats()[name]
        assert stats["retiring_workers"] >= 1 and set(stats["retiring_pids"]) <= old_pids, stats
        assert not set(stats["pids"]) & old_pids, stats
        release.touch()
        assert (await asyncio.wait_for(under_way, 15)).ok
        await _until(lambda: b.stats()[name]["retiring_workers"] == 0, "the old workers to be gone")
        assert b.stats()[name]["retiring_pids"] == []


_COUNTERS = ("calls", "spawned", "cold_starts", "batches")


async def test_pool_counters_carry_on_across_a_reregistration(reloadable, tmp_path):
    """A function registered again got a new pool whose counters (calls, spawned, ...)
    started from 0: stats() and fabric serve's fabric_pool_* series went down within one
    process, which Prometheus reads as a restart (rate() over it is wrong). The counts of
    the pools it replaced carry on, while they run their last calls and after they stop."""
    name, mod_name, reload, _ = reloadable
    started, release = tmp_path / "started", tmp_path / "release"
    reg = Registry()
    reg.discover(mod_name)
    seen: list[dict] = []

    def look(b: LocalBackend) -> dict:
        stats = b.stats()[name]
        if seen:
            for key in _COUNTERS:
                assert stats[key] >= seen[-1][key], (key, seen[-1], stats)
        seen.append(stats)
        return stats

    async with LocalBackend(reg) as b:
        for _ in range(3):
            assert (await b.submit(Invocation(function=name, payload={}))).ok
        under_way = b.submit(
            Invocation(function=name, payload={"started": str(started), "release": str(release)})
        )
        await _until(started.exists, "the run to start on an old worker")
        assert look(b)["calls"] >= 3
        reload()
        reg.discover(mod_name)
        new = await b.submit(Invocation(function=name, payload={}))
        assert new.ok and new.value["code"] == "v2, rewritten", new.error
        stats = look(b)
        assert stats["calls"] >= 4 and stats["spawned"] >= 2, stats
        release.touch()
        assert (await asyncio.wait_for(under_way, 15)).ok
        await _until(lambda: look(b)["retiring_workers"] == 0, "the old workers to be gone")
        stats = look(b)
        # every call counted once: the three, the one that ran on the old pool, the new one
        assert stats["calls"] == 5, stats
        # the gauges are the live pool's own
        assert set(stats["pids"]) == {new.value["pid"]} and stats["workers"] == 1, stats


async def test_fabric_serve_pool_counters_do_not_go_down_on_a_reregistration(reloadable):
    """The same through fabric serve's /metrics: fabric_pool_calls_total fell to the new pool's
    count when the function was registered again."""
    import httpx

    from fabric.serve import Gateway, ServeConfig, TenantConfig

    name, mod_name, reload, _ = reloadable
    token = "token-reregister-0123456789"
    reg = Registry()
    reg.discover(mod_name)
    cfg = ServeConfig(port=0, tenants={"ops": TenantConfig(token=token, metrics="all")}, warm=False)
    headers = {"Authorization": f"Bearer {token}"}
    path = f"/2015-03-31/functions/{name}/invocations"

    async def pool_calls(http: httpx.AsyncClient) -> float:
        text = (await http.get("/metrics", headers=headers)).text
        line = f'fabric_pool_calls_total{{function="{name}"}} '
        return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])

    async with Gateway(cfg, reg) as g, httpx.AsyncClient(base_url=g.url, timeout=30) as http:
        for _ in range(3):
            r = await http.post(path, json={}, headers=headers)
            assert r.status_code == 200 and r.json()["code"] == "v1", r.text
        before = await pool_calls(http)
        assert before == 3
        reload()
        reg.discover(mod_name)
        r = await http.post(path, json={}, headers=headers)
        assert r.status_code == 200 and r.json()["code"] == "v2, rewritten", r.text
        assert await pool_calls(http) == before + 1
