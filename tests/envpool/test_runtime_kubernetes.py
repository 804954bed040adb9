"""The kubernetes runtime against ``FakeKubernetesAPI``: the official client over real HTTP,
each pod a real ``envpool.server`` process on 127.0.0.1 reached over TCP."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from echo_bundle import write_bundle
from pool_util import alive, wait_for

from envpool.errors import ContainerStartError, EnvUsageError
from envpool.images.bundle import build_bundle
from envpool.images.errors import ImageNotFound
from envpool.images.fake_origin import FakeOrigin
from envpool.pool import EnvPool
from envpool.runtimes.base import KubernetesRuntimeConfig
from envpool.runtimes.k8s_fake import FakeKubernetesAPI
from envpool.runtimes.kubernetes import KubernetesRuntime

pytest.importorskip("kubernetes")
# raised inside the kubernetes client when it builds an ApiException, not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:HTTPResponse.getheaders:DeprecationWarning")

IMAGE = "rl-fabric-env:test"


@pytest.fixture
def api() -> Iterator[FakeKubernetesAPI]:
    with FakeKubernetesAPI() as fake:
        yield fake
        pids = fake.processes()
    assert not pids or all(not alive(p) for p in pids)


def pool(api: FakeKubernetesAPI, *, images: object = None, attempts: int = 3, **runtime: object) -> EnvPool:
    rt = {"type": "kubernetes", "host": api.url, "image": IMAGE, "heartbeat_s": 0.2, "start_timeout_s": 15}
    rt.update(runtime)
    cfg = {
        "runtime": rt,
        "min_warm": 0,
        "retry": {"attempts": attempts, "initial_backoff_s": 0.01, "max_backoff_s": 0.05},
    }
    return EnvPool(cfg, images=images)  # type: ignore[arg-type]


async def test_session_over_tcp_with_affinity_and_stop_deletes_the_pod(api):
    async with pool(api) as p:
        async with p.session("echo-v0") as s:
            assert isinstance(p.runtime, KubernetesRuntime)
            await s.reset(seed=3)
            names = set()
            for i in range(4):
                r = await s.step(f"a{i}")
                assert f"a{i}" in r.obs.text
                names.add(s.container.handle)
            assert len(names) == 1  # every step reached the same pod
            (name,) = names
            assert s.container.endpoint.startswith("tcp://127.0.0.1:")
            pod = api.pod(name)
            assert pod["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "envpool"
            c = pod["spec"]["containers"][0]
            assert c["image"] == IMAGE and pod["spec"]["restartPolicy"] == "Never"
            assert c["command"][:6] == [
                "python",
                "-m",
                "envpool.server",
                "--tcp",
                "0.0.0.0:7000",
                "--no-netns",
            ]
            assert c["resources"]["limits"] == {"cpu": "1000m", "memory": "1024Mi"}
            assert api.pod_names() == [name]
        # the session released it idle; closing the pool stops it: the pod is deleted
    assert api.pod_names() == []
    assert api.requests["DELETE pod"] >= 1


async def test_a_pod_killed_behind_the_pools_back_is_replaced(api):
    async with pool(api) as p, p.session("echo-v0") as s:
        await s.reset(seed=1)
        await s.step("x")
        first = s.container.handle
        api.kill(first)
        r = await s.step("y")  # the pool replays reset + "x" on a new pod, then steps
        assert "y" in r.obs.text
        assert s.container.handle != first
        assert first not in api.pod_names()  # the dead pod was deleted, not leaked
        assert p.metrics["replays"] >= 1 and s.status == "ok"
    assert api.pod_names() == []


async def test_image_pull_error_fails_fast_with_the_image_name(api):
    api.image_pull_error_for.add("rl-fabric-env:missing")
    async with pool(api, image="rl-fabric-env:missing", attempts=2) as p:
        # the caller's to fix: not retried (a pod per attempt failing alike), as docker's
        with pytest.raises(
            EnvUsageError, match=r"ErrImagePull.*rl-fabric-env:missing|rl-fabric-env:missing.*ErrImagePull"
        ):
            async with p.session("echo-v0"):
                pass
        assert api.requests["POST pods"] == 1
    assert api.pod_names() == []  # the failed pods were deleted


async def test_a_pull_that_fails_for_a_while_is_waited_for_not_a_failed_start(api):
    # ErrImagePull is often a registry hiccup (a 503, a timeout) the kubelet retries after a
    # back-off: failing the start at the first one threw away a pod that would have run
    api.image_pull_flaky["rl-fabric-env:flaky"] = 2
    async with pool(api, image="rl-fabric-env:flaky", attempts=1) as p, p.session("echo-v0") as s:
        obs, _ = await s.reset(seed=2)
        assert obs.text == "echo ready (seed=2)"
        assert api.requests["POST pods"] == 1 and p.runtime.metrics["start_failures"] == 0
    assert api.pod_names() == []


async def test_a_pull_that_keeps_failing_fails_the_start_naming_the_image_and_the_reason(api):
    api.image_pull_flaky["rl-fabric-env:flaky"] = 10**6
    cfg = KubernetesRuntimeConfig(host=api.url, image="rl-fabric-env:flaky", image_pull_grace_s=1.0)
    rt = KubernetesRuntime(cfg)
    try:
        with pytest.raises(ContainerStartError) as e:
            await rt.start(None, None, timeout_s=30)
        msg = str(e.value)
        assert "rl-fabric-env:flaky" in msg and "503 Service Unavailable" in msg
        assert "for 1 s" in msg and "image_pull_grace_s" in msg
        assert api.pod_names() == []
    finally:
        await rt.aclose()


async def test_a_start_that_times_out_says_what_it_was_waiting_for(api):
    # a pull failing within its grace, when the start's own timeout comes first
    api.image_pull_flaky["rl-fabric-env:flaky"] = 10**6
    rt = KubernetesRuntime(KubernetesRuntimeConfig(host=api.url, image="rl-fabric-env:flaky"))
    try:
        with pytest.raises(ContainerStartError, match=r"not ready in 4 s") as e:
            await rt.start(None, None, timeout_s=4)
        assert "pull" in str(e.value) and "503 Service Unavailable" in str(e.value)
        assert api.pod_names() == []
    finally:
        await rt.aclose()


@pytest.mark.parametrize(
    ("status", "says"),
    [
        (403, r"403 Forbidden.*grant .* get, list, create and delete on pods in namespace default"),
        (401, r"401 Unauthorized.*renew them"),
        (404, r"namespace 'default' not found.*create it, or set runtime\.namespace"),
    ],
)
async def test_a_create_refused_for_the_setup_s_sake_is_a_usage_error_not_retried(api, status, says):
    # RBAC without pods/create, expired credentials, a namespace that is not there: every
    # claim retried them as infra faults (a pod create per attempt), and said not what to fix
    api.fail_next_create.append(status)
    async with pool(api) as p:
        with pytest.raises(EnvUsageError, match=says):
            async with p.session("echo-v0"):
                pass
        assert api.requests["POST pods"] == 1 and p.stats().get("claim_retries", 0) == 0
    assert api.pod_names() == []


async def test_a_create_refused_by_a_full_quota_is_retried(api):
    # a ResourceQuota answers 403 Forbidden too, and frees up as other pods end
    full = 'pods "x" is forbidden: exceeded quota: compute, requested: limits.cpu=1, used: limits.cpu=8'
    api.fail_next_create.append((403, full))
    async with pool(api) as p, p.session("echo-v0") as s:
        await s.reset(seed=0)
        assert api.requests["POST pods"] == 2 and p.metrics["claim_retries"] == 1
        assert "exceeded quota" in s.failures[0]
    assert api.pod_names() == []


async def test_a_pod_no_node_fits_times_out_saying_so(api):
    api.unschedulable = "0/3 nodes are available: 3 Insufficient cpu."
    rt = KubernetesRuntime(KubernetesRuntimeConfig(host=api.url, image=IMAGE, cpu=64))
    try:
        with pytest.raises(ContainerStartError, match=r"not ready in 2 s") as e:
            await rt.start(None, None, timeout_s=2)
        assert "to be scheduled (Unschedulable: 0/3 nodes are available: 3 Insufficient cpu.)" in str(e.value)
        assert "kubectl -n default describe pod envpool-" in str(e.value)
        assert api.pod_names() == []
    finally:
        await rt.aclose()


async def test_api_500_on_create_is_retried(api):
    api.fail_next_create.append(500)
    async with pool(api) as p, p.session("echo-v0") as s:
        await s.reset(seed=0)
        assert api.requests["POST pods"] == 2
        assert p.metrics["claim_retries"] == 1
        assert "500" in s.failures[0] and "InternalError" in s.failures[0]
    assert api.pod_names() == []


async def test_custom_image_is_fetched_by_the_pod_from_the_image_source(host_tmp, api, tmp_path: Path):
    bundle = build_bundle(write_bundle(tmp_path / "src"))
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        # no local image cache at all: the pod fetches the bundle itself
        async with pool(api, image_source=origin.url) as p:
            async with p.session("bundle-echo-v0", image=f"echo@{bundle.digest}") as s:
                obs, _ = await s.reset(seed=5)
                assert obs.text == "ready 5"
                assert (await s.step("hi")).obs.text == "hi #1"
                cmd = api.pod(s.container.handle)["spec"]["containers"][0]["command"]
                assert cmd[cmd.index("--image-digest") + 1] == bundle.digest
                assert cmd[cmd.index("--image-source") + 1] == origin.url
            assert origin.blob_requests[bundle.digest] >= 1
    assert api.pod_names() == []


async def test_an_unknown_image_is_image_not_found_at_once_not_a_retried_start(host_tmp, api):
    # the pod's server fetches its bundle itself; an unknown digest once ended the pod as a
    # generic failure: retried with a new pod per attempt, then masked as infra_failed
    with FakeOrigin({}) as origin:
        async with pool(api, image_source=origin.url) as p:
            with pytest.raises(ImageNotFound, match=r"a{64}"):
                async with p.session("bundle-echo-v0", image="typo@sha256:" + "a" * 64):
                    pass
            assert api.requests["POST pods"] == 1 and p.stats().get("claim_retries", 0) == 0
    assert api.pod_names() == []


async def test_reap_orphans_deletes_pods_of_dead_owners(api):
    async with pool(api) as p:
        rt = p.runtime
        assert isinstance(rt, KubernetesRuntime)
        c = await rt.start(None, None, timeout_s=15)
        # a pod left behind by a process of this host that has since exited
        proc = await asyncio.create_subprocess_exec("true")
        await proc.wait()
        leaked = {
            "metadata": {
                "name": "envpool-dead0",
                "labels": {"app.kubernetes.io/managed-by": "envpool"},
                "annotations": {"envpool.dev/owner": f"{socket.gethostname()}/{proc.pid}/x"},
            },
            "spec": {"containers": [{"name": "c", "image": IMAGE, "command": ["sleep", "60"]}]},
        }
        assert api.create("default", leaked)[0] == 201
        elsewhere = {"envpool.dev/owner": "elsewhere/1/x"}  # another host: not ours to judge
        other = {
            **leaked,
            "metadata": {**leaked["metadata"], "name": "envpool-other0", "annotations": elsewhere},
        }
        assert api.create("default", other)[0] == 201
        # a crashed run of a trainer restarted in its container: this very pid, another start
        start = int(rt.owner.split("/")[1].partition(":")[2])
        earlier = {"envpool.dev/owner": f"{socket.gethostname()}/{os.getpid()}:{start - 1}/y"}
        restarted = {
            **leaked,
            "metadata": {**leaked["metadata"], "name": "envpool-earlier0", "annotations": earlier},
        }
        assert api.create("default", restarted)[0] == 201
        reaped = await rt.reap_orphans()
        assert sorted(reaped) == ["envpool-dead0", "envpool-earlier0"]
        assert sorted(api.pod_names()) == sorted([c.handle, "envpool-other0"])
        api.delete("default", "envpool-other0")
        assert await rt.alive(c)
    assert api.pod_names() == []


class _SlowCreates:
    """An API server under load: each pod create takes ``delay_s`` to land."""

    def __init__(self, api: FakeKubernetesAPI, delay_s: float = 0.5):
        self.inflight = 0
        real_create = api.create

        def slow_create(ns: str, body: dict) -> tuple[int, dict]:
            self.inflight += 1
            try:
                time.sleep(delay_s)
                return real_create(ns, body)
            finally:
                self.inflight -= 1

        api.create = slow_create  # type: ignore[method-assign]

    async def landed(self) -> None:
        """Every create sent so far has landed (a pod given up on is there now, or never)."""
        await wait_for(lambda: self.inflight == 0)


async def test_a_start_given_up_while_its_pod_is_created_leaves_no_pod(api):
    # the start timed out with the create in flight (a thread): its DELETE went first (404),
    # the name was forgotten, and the create then landed: a running pod nobody tracked
    creates = _SlowCreates(api)
    rt = KubernetesRuntime(KubernetesRuntimeConfig(host=api.url, image=IMAGE, heartbeat_s=0.2))
    with pytest.raises(ContainerStartError):
        await rt.start(None, None, timeout_s=0.2)
    await creates.landed()
    assert api.pod_names() == [] and not rt._pods
    await rt.aclose()


async def test_a_start_cancelled_twice_while_its_pod_is_created_leaves_no_pod(api):
    # a second cancellation (the pool closing after the claim was aborted) cut short the wait
    # for the create: the pod must still be deleted once it exists, and stay tracked until then
    creates = _SlowCreates(api)
    rt = KubernetesRuntime(KubernetesRuntimeConfig(host=api.url, image=IMAGE, heartbeat_s=0.2))
    start = asyncio.create_task(rt.start(None, None, timeout_s=15))
    await asyncio.sleep(0.1)
    start.cancel()
    await asyncio.sleep(0.05)
    start.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await start
    await rt.aclose()
    await creates.landed()
    assert api.pod_names() == []


async def test_a_pool_closed_while_a_prestart_creates_its_pod_leaves_no_pod(api):
    creates = _SlowCreates(api)
    p = pool(api, start_timeout_s=15)
    async with p:
        p._keep_warm(None, 2)  # as after a first session: keep 2 warm
        await asyncio.sleep(0.3)  # the maintenance loop's prestarts are creating their pods
        assert creates.inflight
    await creates.landed()
    assert api.pod_names() == []


async def test_a_start_cancelled_as_a_connect_attempt_fails_stays_cancelled(api, monkeypatch):
    # the wait for the pod's server bounded each connect with asyncio.wait_for, which on
    # Python 3.11 raises the attempt's OSError in place of a cancellation that comes in the
    # same loop turn: the start (a timeout or an aborted claim cancels it) polled on until
    # the server listened, with no deadline of its own, and the base's wait for it with it
    attempts: list[asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = []

    def connect(host: str, port: int) -> asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        attempts.append(asyncio.get_running_loop().create_future())
        return attempts[-1]

    monkeypatch.setattr(asyncio, "open_connection", connect)
    rt = KubernetesRuntime(KubernetesRuntimeConfig(host=api.url, image=IMAGE, heartbeat_s=0.2))
    start = asyncio.ensure_future(rt._start(None, None))
    try:
        await wait_for(lambda: bool(attempts), timeout_s=15)  # the pod runs: its server is tried
        attempts[0].set_exception(ConnectionRefusedError("not listening yet"))
        start.cancel()  # in the same loop turn
        await asyncio.wait({start}, timeout=10)
        assert start.done() and start.cancelled()
    finally:
        start.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await start
        await rt.aclose()
    assert api.pod_names() == []


async def test_a_name_taken_by_another_pod_is_a_failed_start_that_leaves_that_pod_alone(api):
    # a create answered 409 AlreadyExists once had its "own" pod deleted as a failed start's
    # cleanup: the pod of that name was another's (the client never resends a POST, so a 409
    # is never our own create landing twice), and it was killed
    other = {
        "metadata": {"name": "envpool-taken0", "labels": {"app.kubernetes.io/managed-by": "envpool"}},
        "spec": {"containers": [{"name": "c", "image": IMAGE, "command": ["sleep", "60"]}]},
    }
    assert api.create("default", other)[0] == 201

    class Colliding(KubernetesRuntime):
        def _pod_name(self) -> str:
            return "envpool-taken0"

    rt = Colliding(KubernetesRuntimeConfig(host=api.url, image=IMAGE, heartbeat_s=0.2))
    with pytest.raises(ContainerStartError, match="409 AlreadyExists"):
        await rt.start(None, None, timeout_s=15)
    await rt.aclose()
    assert api.pod_names() == ["envpool-taken0"] and api.requests["DELETE pod"] == 0
    api.delete("default", "envpool-taken0")


@pytest.mark.parametrize(
    "labels",
    [{"team": "rl fabric"}, {"team": "x" * 64}, {"bad key": "v"}, {"Example.com/team": "v"}, {"team": "-v"}],
)
def test_labels_the_api_server_would_refuse_are_refused_in_the_config(labels):
    # the API server answers 422 Invalid to a pod with such a label: every start failed,
    # retried on every claim, and the pool never had a container
    with pytest.raises(ValueError, match="label"):
        KubernetesRuntimeConfig(labels=labels)
    KubernetesRuntimeConfig(labels={"team": "rl-fabric", "example.com/run_id": "a.1", "empty": ""})


def test_the_fake_api_refuses_invalid_labels_as_the_real_one_does(api):
    pod = {
        "metadata": {"name": "envpool-lbl0", "labels": {"team": "rl fabric"}},
        "spec": {"containers": [{"name": "c", "image": IMAGE, "command": ["sleep", "60"]}]},
    }
    code, body = api.create("default", pod)
    assert code == 422 and body["reason"] == "Invalid" and "metadata.labels" in body["message"]
    assert api.pod_names() == []


def test_a_namespace_that_is_no_dns_label_is_refused_in_the_config():
    with pytest.raises(ValueError, match="namespace"):
        KubernetesRuntimeConfig(namespace="RL_team")


def test_a_missing_kubeconfig_is_a_clear_error_naming_it(tmp_path: Path):
    # the client's own error said "Invalid kube-config file. No configuration found.", no
    # path, and not an envpool error: a typo in the path read as a broken file
    missing = tmp_path / "nope" / "config"
    with pytest.raises(EnvUsageError, match=f"kubeconfig {missing}.*not found"):
        KubernetesRuntime(KubernetesRuntimeConfig(kubeconfig=str(missing)))


def test_no_credentials_at_all_is_a_clear_error(tmp_path: Path, monkeypatch):
    if os.environ.get("KUBECONFIG"):
        pytest.skip("KUBECONFIG is set: the client read it when imported")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    with pytest.raises(EnvUsageError, match=r"in-cluster.*~/.kube/config.*runtime.kubeconfig"):
        KubernetesRuntime(KubernetesRuntimeConfig())


def test_a_pod_whose_delete_failed_at_close_is_deleted_by_the_exit_hook(api):
    # aclose dropped the runtime from the exit hook's list whatever its deletes did: a pod
    # whose delete failed (an API hiccup) at close ran on after the process exited
    from envpool.runtimes.kubernetes import _delete_leftovers

    rt = KubernetesRuntime(KubernetesRuntimeConfig(host=api.url, image=IMAGE, heartbeat_s=0.2))
    c = asyncio.run(rt.start(None, None, timeout_s=15))
    api.fail_next_delete[:] = [500, 500]  # the stop at close, and aclose's own try
    asyncio.run(rt.aclose())
    assert api.pod_names() == [c.handle]
    _delete_leftovers()
    assert api.pod_names() == []


async def test_host_overrides_the_kubeconfig_s_server_and_keeps_its_credentials(api, tmp_path: Path):
    # with host set, the kubeconfig was not read at all: its token was never sent, and a
    # real API server answered every call 401 Unauthorized
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://elsewhere:6443'}}]\n"
        "users: [{name: u, user: {token: tok123}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    rt = KubernetesRuntime(KubernetesRuntimeConfig(host=api.url, kubeconfig=str(kubeconfig), image=IMAGE))
    assert await rt.reap_orphans() == []
    assert api.authorization == "Bearer tok123"
    await rt.aclose()
