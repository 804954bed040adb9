"""The docker runtime. Tests that need an engine are skipped where none runs (never faked);
the arguments it builds and its errors without an engine are tested everywhere."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from envpool.errors import ContainerStartError, EnvUsageError
from envpool.images.errors import ImageNotFound
from envpool.pool import EnvPool
from envpool.protocol import EXIT_IMAGE_NOT_FOUND
from envpool.runtimes.base import DockerRuntimeConfig
from envpool.runtimes.docker import (
    MANAGED_BY,
    OWNER_LABEL,
    DockerRuntime,
    _remove_leftovers,
    _translate,
    run_kwargs,
)

docker = pytest.importorskip("docker")

DIGEST = "sha256:" + "cd" * 32


def _engine() -> bool:
    try:
        client = docker.from_env(timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


ENGINE = _engine()
needs_engine = pytest.mark.skipif(not ENGINE, reason="no Docker engine on this machine")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends: nothing listens


def test_run_arguments_for_the_built_ins():
    cfg = DockerRuntimeConfig(image="envs:1", port=7100, cpu=0.5, memory_mb=256, heartbeat_s=0.2)
    kw = run_kwargs(cfg, None, owner="host/42/ab12")
    assert kw == {
        "image": "envs:1",
        "command": [
            "python",
            "-m",
            "envpool.server",
            "--tcp",
            "0.0.0.0:7100",
            "--no-netns",
            "--heartbeat-s",
            "0.2",
        ],
        "detach": True,
        "ports": {"7100/tcp": ("127.0.0.1", None)},
        "labels": {"app.kubernetes.io/managed-by": "envpool", "envpool.owner": "host/42/ab12"},
        "nano_cpus": 500_000_000,
        "mem_limit": "256m",
        "environment": {},
        "network": None,
    }


def test_run_arguments_for_a_bundle_image():
    cfg = DockerRuntimeConfig(image_source="http://mirror:8080", env={"K": "v"}, network="envnet")
    kw = run_kwargs(cfg, f"echo@{DIGEST}", owner="host/7/x")
    cmd = kw["command"]
    assert cmd[cmd.index("--image-digest") + 1] == DIGEST
    assert cmd[cmd.index("--image-source") + 1] == "http://mirror:8080"
    assert kw["environment"] == {"K": "v"} and kw["network"] == "envnet"
    # without a source the container has nowhere to fetch from: a clear error, not a dead container
    with pytest.raises(ValueError, match=r"needs runtime\.image_source"):
        run_kwargs(DockerRuntimeConfig(), f"echo@{DIGEST}", owner="host/7/x")
    faulty = DockerRuntimeConfig(faults={"crash_rate": 0.1})
    assert '{"crash_rate": 0.1, "hang_rate": 0.0}' in run_kwargs(faulty, None, owner="host/7/x")["command"]


@pytest.mark.parametrize(
    "base_url",
    [f"tcp://127.0.0.1:{_closed_port()}", "unix:///nonexistent/envpool-test/docker.sock"],
    ids=["tcp", "unix"],  # the port differs per process: pytest-xdist's workers must agree
)
async def test_an_unreachable_engine_is_a_clear_error(base_url):
    rt = DockerRuntime(DockerRuntimeConfig(base_url=base_url))
    with pytest.raises(ContainerStartError, match="engine not reachable") as e:
        await rt.start(None, None, timeout_s=20)
    assert base_url in str(e.value) and "runtime.base_url" in str(e.value)
    assert rt.live == {} and rt.metrics["start_failures"] == 1
    await rt.aclose()


def test_a_missing_image_is_the_callers_to_fix():
    cfg = DockerRuntimeConfig(image="nosuch:1")
    err = _translate(docker, docker.errors.ImageNotFound("not found"), cfg, "start a container")
    assert isinstance(err, EnvUsageError) and "docker pull nosuch:1" in str(err)
    err = _translate(docker, docker.errors.APIError("conflict"), cfg, "start a container")
    assert isinstance(err, ContainerStartError) and "refused to start a container" in str(err)


def test_a_network_the_engine_does_not_have_is_the_callers_to_fix():
    # the engine's 404 on create: retried as an engine fault on every claim, a container
    # create per attempt, and the message named no setting
    cfg = DockerRuntimeConfig(network="rl-net")
    missing = docker.errors.NotFound("404", explanation="network rl-net not found")
    err = _translate(docker, missing, cfg, "start a container")
    assert isinstance(err, EnvUsageError) and "rl-net" in str(err) and "runtime.network" in str(err)
    assert "docker network create rl-net" in str(err)


class FakeContainer:
    """What the runtime uses of the SDK's ``Container``."""

    def __init__(
        self, client: FakeClient, labels: dict[str, str], *, port: int, exit_code: int | None, pid: int = 0
    ):
        self.client = client
        self.id = f"{len(client.made) + 1:064x}"
        self.name = self.id[:12]
        self.labels = labels
        self.status = "exited" if exit_code is not None else "running"
        state = {"ExitCode": exit_code} if exit_code is not None else {"Pid": pid}
        self.attrs = {"State": state, "NetworkSettings": {"Ports": {"7000/tcp": [{"HostPort": str(port)}]}}}

    def logs(self, *, stdout: bool = True, stderr: bool = True, **_: object) -> bytes:
        # the server's stdout is its ready line alone (what it prints goes to stderr)
        if self.client.logs_error is not None:
            raise docker.errors.APIError(self.client.logs_error)
        return self.client.stdout if stdout and self.status == "running" else b""

    def reload(self) -> None:
        pass  # the fake's attrs are always current: nothing to refresh

    def remove(self, force: bool = False) -> None:
        if self.client.remove_failures:
            self.client.remove_failures -= 1
            raise docker.errors.APIError("500 Server Error: the engine is busy")
        self.client.made.pop(self.id, None)
        self.status = "removed"


class FakeClient:
    """A docker client without an engine: ``run`` makes a container whose server listens on
    ``port`` (or has exited with ``exit_code``); the containers are kept in ``made``."""

    def __init__(self, *, port: int = 0, exit_code: int | None = None) -> None:
        self.made: dict[str, FakeContainer] = {}
        self.port, self.exit_code = port, exit_code
        self.pid = 0
        """The host pid the engine reports for the next container (its main process)."""
        self.remove_failures = 0
        self.start_error: str | None = None
        """What the engine answers the start of each container ``run`` creates, if it refuses."""
        self.stdout = b'{"ready": true, "pid": 1, "endpoint": "tcp://0.0.0.0:7000"}\n'
        """What a running container's server has printed to stdout (b"": not ready yet)."""
        self.logs_error: str | None = None
        """What the engine answers ``logs`` with, if it cannot (a logging driver it cannot read)."""
        self.containers = self

    def run(self, *, labels: dict[str, str], name: str | None = None, **kw: object) -> FakeContainer:
        # as the SDK's: create, then start; a start the engine refuses raises with the
        # container created, and left there
        ctr = FakeContainer(self, labels, port=self.port, exit_code=self.exit_code, pid=self.pid)
        ctr.name = name or ctr.id[:12]
        self.made[ctr.id] = ctr
        if self.start_error is not None:
            ctr.status = "created"
            raise docker.errors.APIError(self.start_error)
        return ctr

    def get(self, cid: str) -> FakeContainer:
        # by id or by name, as the engine's
        for ctr in self.made.values():
            if cid in (ctr.id, ctr.name):
                return ctr
        raise docker.errors.NotFound(f"no such container {cid}")

    def list(self, *, all: bool = False, filters: dict[str, list[str]] | None = None) -> list[FakeContainer]:
        assert all and filters == {"label": ["app.kubernetes.io/managed-by=envpool"]}
        return list(self.made.values())

    def close(self) -> None:
        pass  # the fake client holds no connection


async def test_an_unknown_image_is_image_not_found_at_once_not_a_retried_start():
    # the container's server fetches its bundle itself; an unknown digest once ended it as a
    # generic failure: retried with a new container per attempt, then masked as infra_failed
    client = FakeClient(port=_closed_port(), exit_code=EXIT_IMAGE_NOT_FOUND)
    rt = DockerRuntime(DockerRuntimeConfig(image_source="http://origin:8080"), client=client)
    with pytest.raises(ImageNotFound, match=r"c{64}.*http://origin:8080"):
        await rt.start("typo@sha256:" + "c" * 64, None, timeout_s=10)
    assert client.made == {} and rt.live == {}  # the exited container was removed
    await rt.aclose()


async def test_a_container_whose_start_the_engine_refused_is_removed():
    # the SDK's run() creates the container, then starts it: a start refused (an image
    # without python: "exec: python: executable file not found") raised with the container
    # created and unknown to us, one more left on the engine per retried start
    client = FakeClient(port=_closed_port())
    client.start_error = '400 Client Error: OCI runtime create failed: exec: "python": not found'
    rt = DockerRuntime(DockerRuntimeConfig(), client=client)
    with pytest.raises(ContainerStartError, match="python"):
        await rt.start(None, None, timeout_s=10)
    assert client.made == {} and rt.live == {}
    await rt.aclose()


async def test_a_refused_start_whose_remove_fails_too_is_tried_again_at_close():
    client = FakeClient(port=_closed_port())
    client.start_error = '400 Client Error: OCI runtime create failed: exec: "python": not found'
    client.remove_failures = 1
    rt = DockerRuntime(DockerRuntimeConfig(), client=client)
    with pytest.raises(ContainerStartError, match="python"):
        await rt.start(None, None, timeout_s=10)
    (ctr,) = client.made.values()
    assert [c.handle for c in rt.leaked.values()] == [ctr.id]
    await rt.aclose()
    assert client.made == {} and rt.leaked == {}


@pytest.fixture
def listening_port():
    with socket.socket() as s:  # stands for a container's published port: connections succeed
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield int(s.getsockname()[1])


async def test_a_container_whose_stop_failed_stays_tracked_and_aclose_removes_it(listening_port):
    # Runtime.stop once dropped the container from `live` before the engine removed it: a
    # failed remove was forgotten, and aclose never tried again (the container ran on)
    client = FakeClient(port=listening_port)
    rt = DockerRuntime(DockerRuntimeConfig(), client=client)
    c = await rt.start(None, None, timeout_s=10)
    client.remove_failures = 1
    with pytest.raises(ContainerStartError, match="refused to remove a container"):
        await rt.stop(c)
    assert c.id in rt.live and len(client.made) == 1 and rt.metrics["stop_failures"] == 1
    await rt.aclose()
    assert client.made == {} and rt.live == {}


async def test_a_container_is_ready_when_its_server_says_so_not_when_its_port_accepts(listening_port):
    # docker-proxy binds the published port as the container starts and accepts every
    # connection, resetting those that come before the server listens: a connect proved
    # nothing, and the pool's first connection to a slow-starting container was reset
    client = FakeClient(port=listening_port)  # the port accepts, as docker-proxy's does
    client.stdout = b""  # and the server has not said it is ready
    rt = DockerRuntime(DockerRuntimeConfig(start_timeout_s=1.0), client=client)
    with pytest.raises(ContainerStartError, match=r"not ready in 1 s.*docker logs"):
        await rt.start(None, None, timeout_s=30)
    assert client.made == {} and rt.live == {}
    client.stdout = b'{"ready": true, "endpoint": "tcp://0.0.0.0:7000"}\n'
    c = await rt.start(None, None, timeout_s=30)
    assert c.id in rt.live
    await rt.aclose()


async def test_a_failed_start_whose_remove_fails_too_raises_its_own_error_and_is_tried_again(
    listening_port,
):
    # the remove's error took the start's place, and the container was tracked nowhere: it
    # ran on (its owner alive, no reaper takes it; the exit hook knows only live and leaked)
    client = FakeClient(port=listening_port)
    client.stdout = b""  # never ready
    client.remove_failures = 1
    rt = DockerRuntime(DockerRuntimeConfig(start_timeout_s=0.5), client=client)
    with pytest.raises(ContainerStartError, match="not ready in"):
        await rt.start(None, None, timeout_s=30)
    (ctr,) = client.made.values()
    assert [c.handle for c in rt.leaked.values()] == [ctr.id] and rt.live == {}
    await rt.aclose()  # tries it again
    assert client.made == {} and rt.leaked == {}


async def test_a_start_that_times_out_says_what_it_was_waiting_for(listening_port):
    client = FakeClient(port=listening_port)
    client.stdout = b""  # never ready
    rt = DockerRuntime(DockerRuntimeConfig(), client=client)
    with pytest.raises(ContainerStartError, match=r"not ready in 3 s.*say it is ready.*docker logs"):
        await rt.start(None, None, timeout_s=3)
    assert client.made == {}
    await rt.aclose()


async def test_a_container_whose_logs_cannot_be_read_is_ready_when_its_port_accepts(listening_port):
    # a logging driver the engine cannot read back (none, a remote one without dual logging)
    client = FakeClient(port=listening_port)
    client.logs_error = "configured logging driver does not support reading"
    rt = DockerRuntime(DockerRuntimeConfig(), client=client)
    c = await rt.start(None, None, timeout_s=10)
    assert c.id in rt.live
    await rt.aclose()


def test_the_exit_hook_removes_the_containers_of_a_runtime_never_closed(listening_port):
    client = FakeClient(port=listening_port)
    rt = DockerRuntime(DockerRuntimeConfig(), client=client)
    asyncio.run(rt.start(None, None, timeout_s=10))  # and never closed (a crashed job)
    assert len(client.made) == 1
    _remove_leftovers()
    assert client.made == {}
    asyncio.run(rt.aclose())


async def test_reap_orphans_removes_containers_of_owners_that_are_gone():
    # a crashed trainer's containers once ran forever: the docker runtime had no reaper
    proc = await asyncio.create_subprocess_exec("true")
    await proc.wait()  # a process of this host that has since exited
    host = socket.gethostname()
    client = FakeClient()
    rt = DockerRuntime(DockerRuntimeConfig(), client=client)
    owners = {
        "dead": f"{host}/{proc.pid}/x",
        "mine": rt.owner,
        "alive": f"{host}/1/x",  # init: alive, someone else's
        "elsewhere": "other-host/1234/x",  # another host sharing the engine: not ours to judge
        "unlabelled": "",
    }
    made = {name: client.run(labels={**MANAGED_BY, OWNER_LABEL: o}) for name, o in owners.items()}
    assert await rt.reap_orphans() == [made["dead"].id]
    assert made["dead"].status == "removed"
    assert sorted(c.id for c in client.made.values()) == sorted(
        made[n].id for n in ("mine", "alive", "elsewhere", "unlabelled")
    )
    await rt.aclose()


def test_an_owner_whose_pid_another_process_took_since_is_gone():
    # a trainer restarted in its container gets the same small pid as the one that crashed:
    # judged by host/pid alone, the crashed run's containers were "alive" (or this process's
    # own) and never reaped. The owner id carries the process's start time too
    from envpool.runtimes._remote import owner_gone, owner_id

    me = owner_id("x")
    host, pid_start, _ = me.split("/")
    pid, _, start = pid_start.partition(":")
    assert pid == str(os.getpid()) and start.isdigit()
    assert not owner_gone(me) and not owner_gone(f"{host}/{pid}:{start}/another-instance")
    assert owner_gone(f"{host}/{pid}:{int(start) - 1}/x")  # this pid, an earlier process
    assert owner_gone(f"{host}/1:{int(start) + 10**9}/x")  # init's pid, not init
    assert not owner_gone(f"{host}/1/x")  # an id without a start time: judged by its pid
    assert not owner_gone(f"other-host/{pid}:1/x")


@pytest.fixture
def cgroup_of() -> Iterator[Callable[[str, int], None]]:
    """Put a process in a cgroup named after a container id, as a local engine places a
    container's processes (``docker-<id>.scope``). Skipped where cgroups cannot be made."""
    made: list[Path] = []

    def put(cid: str, pid: int) -> None:
        group = Path("/sys/fs/cgroup/cpu") / f"docker-{cid}.scope"
        try:
            group.mkdir()
            made.append(group)
            (group / "cgroup.procs").write_text(str(pid))
        except OSError as e:
            pytest.skip(f"cannot make a cgroup here: {e}")

    yield put
    for group in made:
        with contextlib.suppress(OSError):
            group.rmdir()


async def test_the_cpu_of_a_container_on_this_engines_host_is_read_and_no_other_process(
    listening_port, cgroup_of
):
    # the remote runtimes had no CPU probe: an environment holding the interpreter lock (no
    # heartbeats) in a docker container read as a frozen container, retried and replayed on
    # fresh ones until the session was lost, where the process runtime fails it as EnvHung
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", burn + "print('burnt', flush=True)\ntime.sleep(60)", stdout=subprocess.PIPE
    )
    client = FakeClient(port=listening_port)
    rt = DockerRuntime(DockerRuntimeConfig(), client=client)
    try:
        client.pid = server.pid  # the engine's host pid of the container's server
        cgroup_of(f"{len(client.made) + 1:064x}", server.pid)  # the id run() gives it
        assert server.stdout is not None and await server.stdout.readline() == b"burnt\n"
        c = await rt.start(None, None, timeout_s=10)
        cpu = rt.cpu_seconds(c)
        assert cpu is not None and cpu >= 0.3
        # a pid that is not the container's (an engine on another host, or in another pid
        # namespace, reports pids of its own) is never read
        client.pid = os.getpid()
        other = await rt.start(None, None, timeout_s=10)
        assert rt.cpu_seconds(other) is None
        server.kill()
        await server.wait()
        assert rt.cpu_seconds(c) is None  # gone: its pid may be another process's next
    finally:
        with contextlib.suppress(ProcessLookupError):
            server.kill()
        await server.wait()
        await rt.aclose()


def test_make_runtime_builds_it_from_a_dict():
    p = EnvPool({"runtime": {"type": "docker", "base_url": "tcp://127.0.0.1:1"}})
    assert isinstance(p.runtime, DockerRuntime) and p.runtime.config.base_url == "tcp://127.0.0.1:1"


# -- with an engine ----------------------------------------------------------------------
IMAGE = os.environ.get("ENVPOOL_DOCKER_IMAGE", "rl-fabric-env:latest")
"""An image with rl-fabric installed (``make docker-image``, or set ENVPOOL_DOCKER_IMAGE)."""


def _have_image() -> bool:
    if not ENGINE:
        return False
    client = docker.from_env()
    try:
        client.images.get(IMAGE)
        return True
    except docker.errors.ImageNotFound:
        return False
    finally:
        client.close()


needs_image = pytest.mark.skipif(not _have_image(), reason=f"no Docker engine, or no {IMAGE} image")


@needs_engine
@needs_image
async def test_a_session_runs_in_a_docker_container():
    cfg = {"min_warm": 0, "runtime": {"type": "docker", "image": IMAGE, "heartbeat_s": 0.2}}
    async with EnvPool(cfg) as p:
        async with p.session("echo-v0") as s:
            obs, _ = await s.reset(seed=2)
            assert obs.text == "echo ready (seed=2)" and (await s.step("x")).obs.text == "x"
            assert s.container is not None and s.container.endpoint.startswith("tcp://127.0.0.1:")
            cid = s.container.handle
    client = docker.from_env()
    try:
        with pytest.raises(docker.errors.NotFound):
            client.containers.get(cid)  # removed when the pool closed
    finally:
        client.close()


@needs_engine
@needs_image
async def test_a_killed_container_is_not_alive_and_stop_ignores_it():
    rt = DockerRuntime(DockerRuntimeConfig(image=IMAGE))
    c = await rt.start(None, None, timeout_s=60)
    assert await rt.alive(c)
    client = docker.from_env()
    try:
        client.containers.get(c.handle).remove(force=True)
    finally:
        client.close()
    assert not await rt.alive(c)
    await rt.stop(c)  # NotFound is fine
    await rt.aclose()


@needs_engine
async def test_an_image_the_engine_cannot_find_is_a_clear_error():
    rt = DockerRuntime(DockerRuntimeConfig(image="envpool-test/no-such-image:0"))
    with pytest.raises((EnvUsageError, ContainerStartError), match="no-such-image"):
        await rt.start(None, None, timeout_s=60)
    await rt.aclose()


@pytest.mark.parametrize("kind", ["docker", "kubernetes", "modal"])
@pytest.mark.parametrize(
    "image", ["", "Rl-Fabric-Env:1", "rl fabric:1", "env:", "env:bad tag", "env@sha256:xyz"]
)
def test_an_image_reference_no_registry_accepts_is_refused_in_the_config(kind, image):
    # the engine ("invalid reference format"), the kubelet (InvalidImageName) and Modal refuse
    # it on each container: a start failure, retried on every claim, never a container
    with pytest.raises(ValueError, match="image"):
        EnvPool({"runtime": {"type": kind, "image": image}})


@pytest.mark.parametrize(
    "image",
    [
        "rl-fabric-env:latest",
        "registry.example.com:5000/team/rl_fabric-env:1.2",
        "localhost/env",
        "ghcr.io/org/env@sha256:" + "ab" * 32,
        "ghcr.io/org/env:1@sha256:" + "ab" * 32,
    ],
)
def test_image_references_registries_accept_are_kept(image):
    assert DockerRuntimeConfig(image=image).image == image


def test_a_remote_containers_image_caps_are_the_runtimes_to_raise():
    # the container fetches its bundle itself, through a cache with the tier's and the
    # cache's default caps: an image over them could not be run there, with no key to raise
    from envpool.images import CacheConfig, OriginTierConfig

    defaults = DockerRuntimeConfig()
    assert defaults.image_max_blob_bytes == OriginTierConfig(url="http://o:1").max_blob_bytes
    assert defaults.image_max_unpacked_bytes == CacheConfig.model_fields["max_unpacked_bytes"].default
    cfg = DockerRuntimeConfig(image_source="http://mirror:8080", image_max_blob_bytes=5 * 2**30)
    cmd = run_kwargs(cfg, f"echo@{DIGEST}", owner="host/7/x")["command"]
    assert cmd[cmd.index("--image-max-blob-bytes") + 1] == str(5 * 2**30)
    assert cmd[cmd.index("--image-max-unpacked-bytes") + 1] == str(defaults.image_max_unpacked_bytes)
