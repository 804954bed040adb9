"""The modal runtime against ``envpool.runtimes.modal_fake`` (each sandbox a local server
process), and the real ``modal`` package without a token."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import pytest
from pool_util import swap_runtime

from envpool.connection import Connection
from envpool.errors import ContainerDied, ContainerStartError, EnvUsageError, InfraError
from envpool.images.errors import ImageNotFound
from envpool.images.fake_origin import FakeOrigin
from envpool.pool import EnvPool
from envpool.runtimes.base import ModalRuntimeConfig
from envpool.runtimes.modal_ import ModalRuntime
from envpool.runtimes.modal_fake import FakeModal

DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def fake():
    f = FakeModal()
    yield f
    f.close()


@contextlib.asynccontextmanager
async def modal_pool(fake: FakeModal, **cfg) -> AsyncIterator[EnvPool]:
    cfg.setdefault("min_warm", 0)
    cfg.setdefault("runtime", {"type": "modal", "heartbeat_s": 0.2})
    p = EnvPool(cfg)
    assert isinstance(p.config.runtime, ModalRuntimeConfig)
    await swap_runtime(p, ModalRuntime(p.config.runtime, modal_module=fake))
    async with p:
        yield p


async def test_a_session_runs_over_a_sandbox_tunnel(fake):
    async with modal_pool(fake) as p, p.session("echo-v0") as s:
        obs, info = await s.reset(seed=3)
        assert obs.text == "echo ready (seed=3)" and info == {"seed": 3}
        assert (await s.step("hi")).obs.text == "hi"
        c = s.container
        assert c is not None and c.runtime == "modal" and c.endpoint.startswith("tcp://127.0.0.1:")
        assert c.handle in fake.running()
        sb = fake.sandboxes[c.handle]
        assert sb.app.name == "rl-fabric-envs" and sb.image.tag == "rl-fabric-env:latest"
        assert sb.kwargs == {
            "timeout": 3600,
            "unencrypted_ports": [7000],
            "cpu": 1.0,
            "memory": (1024, 1024),
            "readiness_probe": fake.Probe.with_tcp(7000),
            "tags": {
                "managed-by": "envpool",
                "envpool-host": socket.gethostname(),
                "envpool-owner": p.runtime.owner,
            },
        }


async def test_a_sandbox_s_memory_is_a_limit_as_a_pod_s_and_a_docker_container_s(fake):
    # a bare ``memory`` is only Modal's request (no limit): an environment that leaked memory
    # grew without bound, billed, where kubernetes and docker would have stopped it
    rt = ModalRuntime(ModalRuntimeConfig(memory_mb=512), modal_module=fake)
    _, kw = rt.create_args(None)
    assert kw["memory"] == (512, 512)


async def test_block_network_cuts_outbound_traffic_and_still_serves_the_tunnel(fake):
    # Modal refuses ``block_network=True`` with open ports (InvalidError): every start failed,
    # retried on every claim. An empty outbound allow-list blocks what it meant to, tunnel kept
    async with modal_pool(fake, runtime={"type": "modal", "block_network": True}) as p:
        async with p.session("echo-v0") as s:
            await s.reset(seed=0)
            assert (await s.step("hi")).obs.text == "hi"
            kw = fake.sandboxes[s.container.handle].kwargs
            assert kw["outbound_cidr_allowlist"] == [] and "block_network" not in kw


def test_the_fake_refuses_what_modal_refuses():
    fake = FakeModal()
    app = fake.App.lookup("a", create_if_missing=True)
    with pytest.raises(fake.exception.InvalidError, match="block_network"):
        fake.Sandbox.create("true", app=app, block_network=True, unencrypted_ports=[7000])
    with pytest.raises(fake.exception.InvalidError, match="environment variables"):
        fake.Sandbox.create("true", app=app, env={"A-B": "1"})
    with pytest.raises(TypeError, match="no_such_option"):
        fake.Sandbox.create("true", app=app, no_such_option=1)
    assert fake.sandboxes == {}


def test_the_sandbox_command_serves_tcp_and_fetches_a_bundle_by_digest():
    cfg = ModalRuntimeConfig(image_source="http://mirror:8080", env={"A": "1"}, block_network=True)
    args, kw = ModalRuntime(cfg, modal_module=FakeModal()).create_args(f"echo@{DIGEST}")
    assert args[:6] == ["python", "-m", "envpool.server", "--tcp", "0.0.0.0:7000", "--no-netns"]
    assert args[args.index("--image-digest") + 1] == DIGEST
    assert args[args.index("--image-source") + 1] == "http://mirror:8080"
    assert kw["env"] == {"A": "1"} and kw["outbound_cidr_allowlist"] == []


async def test_reconnect_by_sandbox_id_gives_a_working_container(fake):
    cfg = ModalRuntimeConfig(heartbeat_s=0.2)
    first = ModalRuntime(cfg, modal_module=fake)
    c = await first.start(None, None, timeout_s=30)
    # another runtime (a restarted pool) finds the sandbox by its id alone
    again = ModalRuntime(cfg, modal_module=fake)
    c2 = await again.reconnect(c.handle)
    assert c2.endpoint == c.endpoint and c2.id in again.live and await again.alive(c2)
    conn = await Connection.open(c2.endpoint, heartbeat_s=0.2, misses=4, tool_caller=None)
    try:
        await conn.request({"op": "open", "id": 0, "token": "t", "env_id": "echo-v0", "kwargs": {}}, 10)
        step = await conn.request({"op": "reset", "token": "t", "args": {"seed": 1}}, 10)
        assert step["obs"]["text"] == "echo ready (seed=1)"
    finally:
        conn.close()
    await again.aclose()  # stop terminates the sandbox, whoever started it
    assert fake.running() == [] and not await first.alive(c)
    with pytest.raises(ContainerDied, match="has exited"):
        await again.reconnect(c.handle)
    await first.aclose()


async def test_a_sandbox_that_dies_is_replaced_and_the_episode_replayed(fake):
    async with modal_pool(fake) as p, p.session("echo-v0") as s:
        await s.reset(seed=1)
        await s.step("a")
        assert s.container is not None
        old = s.container.handle
        fake.kill(old)
        r = await s.step("b")
        assert r.obs.text == "b" and r.info == {"steps": 2}  # same episode, on a new sandbox
        assert s.container is not None and s.container.handle != old and s.status == "ok"
        assert p.stats()["replays"] == 1
        assert fake.running() == [s.container.handle]


async def test_an_unknown_image_is_image_not_found_at_once_not_a_retried_start(host_tmp, fake):
    # the sandbox's server fetches its bundle itself and exits with EXIT_IMAGE_NOT_FOUND
    rt = {"type": "modal", "heartbeat_s": 0.2}
    with FakeOrigin({}) as origin:
        async with modal_pool(fake, runtime={**rt, "image_source": origin.url}) as p:
            with pytest.raises(ImageNotFound, match=r"b{64}"):
                async with p.session("bundle-echo-v0", image="typo@sha256:" + "b" * 64):
                    pass
            assert len(fake.sandboxes) == 1 and p.stats().get("claim_retries", 0) == 0
    assert fake.running() == []


async def test_stop_terminates_every_sandbox(fake):
    async with modal_pool(fake, min_warm=2) as p:
        await p.prewarm(None)
        async with p.session("echo-v0") as s:
            await s.reset()
        assert len(fake.running()) >= 2
    assert fake.running() == [] and len(fake.sandboxes) >= 2


async def test_a_missing_token_is_a_clear_error_at_once():
    rt = ModalRuntime(ModalRuntimeConfig(), modal_module=FakeModal(authenticated=False))
    with pytest.raises(EnvUsageError, match="modal token new"):
        await rt.start(None, None, timeout_s=5)
    assert rt.live == {}


def _has_modal_token() -> bool:
    import modal.config

    return bool(modal.config.config.get("token_id"))


async def test_the_real_modal_without_a_token_is_a_clear_error_at_once():
    pytest.importorskip("modal")
    if _has_modal_token():
        pytest.skip("a Modal token is configured here: this test is for machines without one")
    rt = ModalRuntime(ModalRuntimeConfig())
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(EnvUsageError, match="modal token new"):
        await rt.start(None, None, timeout_s=20)
    assert loop.time() - t0 < 5  # modal checks the token before any network call


async def test_a_missing_token_ends_a_session_without_retries():
    p = EnvPool({"min_warm": 0, "runtime": {"type": "modal"}})
    await swap_runtime(p, ModalRuntime(p.config.runtime, modal_module=FakeModal(authenticated=False)))  # type: ignore[arg-type]
    async with p:
        with pytest.raises(EnvUsageError, match="not authenticated"):
            async with p.session("echo-v0"):
                pass
        assert p.stats().get("claim_retries", 0) == 0


@pytest.mark.parametrize("after_s", [0.0, 0.1, 0.4])
async def test_a_start_cancelled_midway_leaves_no_sandbox(after_s):
    # cancelled before, during (create takes 0.2 s) and after the sandbox's create call
    fake = FakeModal(create_delay_s=0.2)
    rt = ModalRuntime(ModalRuntimeConfig(), modal_module=fake)
    t = asyncio.get_running_loop().create_task(rt.start(None, None, timeout_s=30))
    await asyncio.sleep(after_s)
    t.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await t
    await rt.aclose()
    await asyncio.sleep(0.3)  # a create still running in its thread would have finished by now
    try:
        assert fake.running() == []
    finally:
        fake.close()


def test_the_exit_hook_terminates_the_sandboxes_of_a_runtime_never_closed():
    # docker and kubernetes had this backstop, modal none: a crashed job's sandboxes ran on,
    # billed, until their timeout_s (an hour by default)
    from envpool.runtimes.modal_ import _terminate_leftovers

    fake = FakeModal()
    try:
        rt = ModalRuntime(ModalRuntimeConfig(heartbeat_s=0.2), modal_module=fake)
        asyncio.run(rt.start(None, None, timeout_s=30))  # and never closed
        assert len(fake.running()) == 1
        _terminate_leftovers()
        assert fake.running() == []
        asyncio.run(rt.aclose())
    finally:
        fake.close()


def test_an_environment_variable_name_modal_refuses_is_refused_in_the_config():
    # Modal refuses the sandbox (InvalidError) on each start: retried on every claim
    with pytest.raises(ValueError, match="A-B"):
        ModalRuntimeConfig(env={"A-B": "1"})
    assert ModalRuntimeConfig(env={"_A1": "x"}).env == {"_A1": "x"}


async def test_a_sandbox_is_ready_when_its_server_listens_not_when_its_tunnel_exists():
    # Modal's tunnel is up (and accepts connections) before the server inside listens: a
    # start that took an accepted connection for a listening server handed the pool a
    # sandbox whose first connection was reset, counted failed, on every claim
    fake = FakeModal(listen_delay_s=1.0)
    try:
        async with modal_pool(fake) as p, p.session("echo-v0") as s:
            obs, _ = await s.reset(seed=1)
            assert obs.text == "echo ready (seed=1)"
            assert len(fake.sandboxes) == 1 and p.stats().get("claim_retries", 0) == 0
            probe = fake.sandboxes[s.container.handle].kwargs["readiness_probe"]
            assert probe.tcp_port == 7000  # Modal probes the port inside the sandbox
    finally:
        fake.close()


async def test_a_server_that_never_listens_is_a_clear_start_error_and_no_sandbox_is_left():
    fake = FakeModal(listen_delay_s=3600)
    rt = ModalRuntime(ModalRuntimeConfig(start_timeout_s=1.5), modal_module=fake)
    try:
        with pytest.raises(ContainerStartError, match=r"not listening on port 7000 within 1\.5 s") as e:
            await rt.start(None, None, timeout_s=30)
        assert "modal container logs" in str(e.value)  # where to look
        assert fake.running() == [] and rt.live == {}
    finally:
        await rt.aclose()
        fake.close()


def test_a_modal_sdk_without_readiness_probes_is_refused_with_what_to_install():
    # before modal 1.4.1 a start cannot tell a listening server from the tunnel before it
    old = FakeModal()
    del old.Probe
    with pytest.raises(EnvUsageError, match=r"modal>=1\.4\.1"):
        ModalRuntime(ModalRuntimeConfig(), modal_module=old)


async def test_reap_orphans_terminates_the_sandboxes_of_owners_that_are_gone(fake):
    # docker and kubernetes reaped what a crashed pool left; modal did not, and a crashed
    # trainer's sandboxes ran, billed, until their timeout_s (an hour by default)
    proc = await asyncio.create_subprocess_exec("true")
    await proc.wait()  # a process of this host that has since exited
    host = socket.gethostname()
    rt = ModalRuntime(ModalRuntimeConfig(heartbeat_s=0.2), modal_module=fake)
    mine = await rt.start(None, None, timeout_s=30)
    tags = fake.sandboxes[mine.handle].tags
    assert tags == {"managed-by": "envpool", "envpool-host": host, "envpool-owner": rt.owner}
    app = fake.App.lookup("rl-fabric-envs")
    owners = {
        "dead": f"{host}/{proc.pid}/x",
        "alive": f"{host}/1/x",  # init: alive, someone else's
    }
    made = {
        name: fake.Sandbox.create("sleep", "60", app=app, tags={**tags, "envpool-owner": o}).object_id
        for name, o in owners.items()
    }
    # another host's (its owner's liveness cannot be seen from here), and a sandbox not ours
    made["elsewhere"] = fake.Sandbox.create(
        "sleep", "60", app=app, tags={**tags, "envpool-host": "other", "envpool-owner": "other/9/x"}
    ).object_id
    made["untagged"] = fake.Sandbox.create("sleep", "60", app=app).object_id
    assert await rt.reap_orphans() == [made["dead"]]
    assert sorted(fake.running()) == sorted([mine.handle, made["alive"], made["elsewhere"], made["untagged"]])
    assert rt.metrics["reaped_orphans"] == 1
    await rt.aclose()


async def test_a_pool_reaps_modal_orphans_as_it_opens(fake):
    proc = await asyncio.create_subprocess_exec("true")
    await proc.wait()
    host = socket.gethostname()
    app = fake.App.lookup("rl-fabric-envs", create_if_missing=True)
    tags = {"managed-by": "envpool", "envpool-host": host, "envpool-owner": f"{host}/{proc.pid}/x"}
    orphan = fake.Sandbox.create("sleep", "60", app=app, tags=tags).object_id
    async with modal_pool(fake) as p:
        assert orphan not in fake.running() and p.stats()["orphans_reaped"] == 1


async def test_a_modal_api_hiccup_while_a_claim_probes_a_sandbox_is_retried_not_raised_raw(fake):
    # the probe let Modal's own error out: not an InfraError, so the session ended at once
    # on an API hiccup, with an exception of the SDK's that no caller expects
    async with modal_pool(fake, min_warm=1) as p:
        await p.prewarm(None)
        fake.fail_next.append(fake.exception.Error("UNAVAILABLE: the API is overloaded"))
        async with p.session("echo-v0") as s:
            obs, _ = await s.reset(seed=4)
            assert obs.text == "echo ready (seed=4)"
        assert p.stats()["claim_retries"] == 1


async def test_a_failed_probe_is_an_infra_error_naming_the_sandbox(fake):
    rt = ModalRuntime(ModalRuntimeConfig(heartbeat_s=0.2), modal_module=fake)
    c = await rt.start(None, None, timeout_s=30)
    fake.fail_next.append(fake.exception.Error("UNAVAILABLE"))
    with pytest.raises(InfraError, match=c.handle):
        await rt.alive(c)
    assert await rt.alive(c)
    await rt.aclose()


async def test_a_failed_start_whose_terminate_fails_too_raises_its_own_error_and_is_tried_again():
    # the terminate's error (Modal's own) took the start's place, and the sandbox was
    # tracked nowhere: it ran, billed, until its timeout_s (its owner alive, no reaper took it)
    fake = FakeModal(listen_delay_s=3600)
    rt = ModalRuntime(ModalRuntimeConfig(start_timeout_s=1.0), modal_module=fake)
    try:
        fake.fail_next_terminate.append(fake.exception.Error("UNAVAILABLE"))
        with pytest.raises(ContainerStartError, match="not listening"):
            await rt.start(None, None, timeout_s=30)
        (sid,) = fake.running()
        assert [c.handle for c in rt.leaked.values()] == [sid]
        await rt.aclose()  # tries it again
        assert fake.running() == [] and rt.leaked == {}
    finally:
        fake.close()


async def test_a_start_that_times_out_says_what_it_was_waiting_for():
    # the pool's timeout is start_timeout_s, the runtime's own wait's too: the start's generic
    # "not ready" always came first, and never said what to look at
    fake = FakeModal(listen_delay_s=3600)
    rt = ModalRuntime(ModalRuntimeConfig(), modal_module=fake)
    try:
        with pytest.raises(ContainerStartError, match=r"not ready in 4 s") as e:
            await rt.start(None, None, timeout_s=4)
        assert "listen on port 7000" in str(e.value) and "modal container logs sb-fake1" in str(e.value)
        assert fake.running() == []
    finally:
        await rt.aclose()
        fake.close()


async def test_settings_modal_refuses_are_a_usage_error_not_a_retried_start(fake):
    # Modal's InvalidError (cpu or memory past its limits, a region it does not have) fails
    # the same on every attempt: it was retried on every claim, a create per attempt
    rt = ModalRuntime(ModalRuntimeConfig(cpu=512), modal_module=fake)
    await rt.reap_orphans()  # (the app looked up: the next API call is the create)
    fake.fail_next.append(fake.exception.InvalidError("cpu request 512 exceeds the maximum of 64"))
    with pytest.raises(EnvUsageError, match=r"exceeds the maximum.*runtime"):
        await rt.start(None, None, timeout_s=30)
    assert fake.sandboxes == {}
    await rt.aclose()


async def test_a_sandbox_near_its_timeout_is_retired_not_handed_to_an_episode(fake):
    # Modal ends a sandbox at timeout_s whatever it runs: a warm one claimed a minute before
    # died mid-episode (a replay at best). Near its end it is no longer alive to a claim
    rt = ModalRuntime(ModalRuntimeConfig(timeout_s=600, heartbeat_s=0.2), modal_module=fake)
    c = await rt.start(None, None, timeout_s=30)
    assert await rt.alive(c)
    c.started_at = time.monotonic() - (600 - 90)  # 90 s left: fine (the margin: a tenth, 60 s)
    assert await rt.alive(c)
    c.started_at = time.monotonic() - (600 - 30)  # 30 s left
    assert not await rt.alive(c)
    assert c.handle in fake.running()  # (the pool stops what is not alive)
    await rt.aclose()
