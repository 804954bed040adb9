"""The ``kubernetes`` runtime: each container is a pod running ``python -m envpool.server``
over TCP, created through the official client (its sync API, in worker threads).

    EnvPool({"runtime": {"type": "kubernetes", "image": "registry/rl-fabric-env:1.2", "namespace": "rl"}})

A pod is ready when its phase is Running, it has an IP, and its server accepts a TCP
connection at ``podIP:port``. The port is the container spec's ``containerPort``
(``config.port``) unless the pod carries an ``envpool.dev/port`` annotation, which wins:
the fake API (``envpool.runtimes.k8s_fake``) runs every pod on 127.0.0.1 and uses that
annotation to say which port it picked.

The pool connects to the pod's IP directly: it must run where the pod network is routable
(in the cluster, or on a node or VPN that reaches it). From outside, every start waits for
its timeout and fails, the pod deleted.

A pull that fails (ErrImagePull, ImagePullBackOff) is waited out while the kubelet pulls
again, up to ``image_pull_grace_s``: a registry's hiccup passes. One the registry answers
with not found or access denied fails the start at once, naming the image and the cause, as
the caller's to fix (``EnvUsageError``: not retried, as the docker runtime's missing image).

A custom environment image is not mounted into the pod (the pool's local bundle is of no
use there): the pod's server fetches the bundle by digest from ``config.image_source``.

Every pod is labelled ``app.kubernetes.io/managed-by: envpool`` and annotated with its owner
(``envpool.dev/owner``: host/pid:start/runtime instance, ``_remote.owner_id``).
``reap_orphans()`` deletes pods whose owner on this host is gone; an exit hook deletes what
this process still holds.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import re
import secrets
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envpool.errors import ContainerStartError, EnvPoolError, EnvUsageError, InfraError
from envpool.protocol import EXIT_IMAGE_NOT_FOUND
from envpool.runtimes._remote import (
    create_or_clean,
    image_not_found,
    owner_gone,
    owner_id,
    owner_is_this_process,
    parse_owner,
    server_command,
)
from envpool.runtimes.base import Container, KubernetesRuntimeConfig, Runtime

MANAGED_BY = ("app.kubernetes.io/managed-by", "envpool")
OWNER_ANNOTATION = "envpool.dev/owner"
PORT_ANNOTATION = "envpool.dev/port"
IMAGE_ANNOTATION = "envpool.dev/image"
# waiting reasons that never resolve by themselves: fail the start now, not at its timeout
_FATAL_WAITING = frozenset(
    {
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "CrashLoopBackOff",
    }
)
# a failed pull: the kubelet pulls again after a back-off, and a registry's hiccup (a 5xx, a
# timeout, a rate limit) passes; one that says the image is not there, or not ours to pull,
# does not (the runtime's message, then the registry's, as containerd and CRI-O word them)
_PULL_WAITING = frozenset({"ErrImagePull", "ImagePullBackOff"})
_PULL_FOR_GOOD = re.compile(
    r"not ?found|manifest unknown|does not exist|access denied|unauthorized|forbidden|"
    r"authorization failed|denied:",
    re.IGNORECASE,
)
_REQUEST_TIMEOUT_S = 10.0

_RUNTIMES: weakref.WeakSet[KubernetesRuntime] = weakref.WeakSet()


@atexit.register
def _delete_leftovers() -> None:
    # exit backstop: a pool that was never closed does not leave its pods running
    for rt in list(_RUNTIMES):
        for name in list(rt._pods):
            with contextlib.suppress(Exception):
                rt._core.delete_namespaced_pod(
                    name, rt.config.namespace, grace_period_seconds=0, _request_timeout=2
                )


def _import_kubernetes() -> Any:
    try:
        import kubernetes
    except ImportError as e:
        raise ImportError(
            "the kubernetes runtime needs the official client: pip install 'rl-fabric[kubernetes]'"
        ) from e
    return kubernetes


def _override_host(conf: Any, host: str) -> None:
    """Point ``conf`` at ``host``, for good: with a token, the kubeconfig loader's refresh hook
    (run before each request) sets the kubeconfig's server again."""
    conf.host = host
    hook = conf.refresh_api_key_hook
    if hook is not None:

        def refresh(c: Any) -> None:
            hook(c)
            c.host = host

        conf.refresh_api_key_hook = refresh


async def _accepts(host: str, port: int, timeout_s: float) -> bool:
    """Whether a server at ``host:port`` accepts a connection within ``timeout_s`` (closed
    at once). Not ``wait_for``: on Python 3.11 it returns the attempt's outcome (or raises
    its OSError) in place of a cancellation that comes in the same loop turn, and a start
    cancelled then (timed out, aborted) polled on until the server listened."""
    attempt = asyncio.ensure_future(asyncio.open_connection(host, port))
    try:
        await asyncio.wait((attempt,), timeout=timeout_s)
    finally:
        if not attempt.done():
            attempt.cancel()  # timed out, or we were cancelled: it closes its socket
        elif not attempt.cancelled() and attempt.exception() is None:
            attempt.result()[1].close()
    return attempt.done() and not attempt.cancelled() and attempt.exception() is None


class _Pulls:
    """What one start has seen of its pod's failing pulls."""

    def __init__(self) -> None:
        self.since: float | None = None
        """When the first failed pull was seen (``time.monotonic``)."""
        self.cause = ""
        """The last failed pull's message (ErrImagePull's: the back-off's says none)."""


class KubernetesRuntime(Runtime):
    kind = "kubernetes"
    uses_local_bundle = False  # the pod fetches its bundle from config.image_source

    def __init__(self, config: KubernetesRuntimeConfig | None = None):
        super().__init__()
        self.config = config or KubernetesRuntimeConfig()
        k8s = _import_kubernetes()
        self._ApiException: type[Exception] = k8s.client.exceptions.ApiException
        self._api_client = k8s.client.ApiClient(self._client_configuration(k8s))
        self._core = k8s.client.CoreV1Api(self._api_client)
        self._instance = secrets.token_hex(4)
        self.owner = owner_id(self._instance)
        self._pods: set[str] = set()
        """Pods this runtime created and has not deleted (starting ones included)."""
        self._creating: dict[str, asyncio.Future[Any]] = {}
        """Pod name -> its create call, while it is in flight (a thread no cancellation stops)."""
        _RUNTIMES.add(self)

    def _client_configuration(self, k8s: Any) -> Any:
        cfg = self.config
        conf = k8s.client.Configuration()
        if cfg.host and not cfg.kubeconfig:  # an API server without auth (the fake in tests)
            conf.host = cfg.host.rstrip("/")
            return conf
        # the client's errors say "Invalid kube-config file. No configuration found." for a
        # file that is not there, naming none: ours say which, and what to set
        if cfg.kubeconfig:
            if not os.path.isfile(os.path.expanduser(cfg.kubeconfig)):
                raise EnvUsageError(f"kubernetes: kubeconfig {cfg.kubeconfig} not found (runtime.kubeconfig)")
            try:
                k8s.config.load_kube_config(config_file=cfg.kubeconfig, client_configuration=conf)
            except k8s.config.ConfigException as e:
                raise EnvUsageError(f"kubernetes: kubeconfig {cfg.kubeconfig}: {e}") from e
            if cfg.host:  # its server only: the kubeconfig's credentials are kept
                _override_host(conf, cfg.host.rstrip("/"))
            return conf
        try:
            k8s.config.load_incluster_config(client_configuration=conf)
        except k8s.config.ConfigException:
            try:
                k8s.config.load_kube_config(client_configuration=conf)
            except k8s.config.ConfigException as e:
                raise EnvUsageError(
                    f"kubernetes: no credentials: not in-cluster (no service account), and no "
                    f"usable kubeconfig at $KUBECONFIG or ~/.kube/config ({e}); set "
                    "runtime.kubeconfig, or runtime.host for an API server without auth"
                ) from e
        return conf

    # ------------------------------------------------------------------ API calls
    async def _api(
        self, fn: Callable[..., Any], *args: Any, what: str, start: bool = False, **kw: Any
    ) -> Any:
        """Call the sync client in a worker thread; its errors become envpool's (the one
        place they are translated): ContainerStartError while starting, else InfraError."""
        kw.setdefault("_request_timeout", _REQUEST_TIMEOUT_S)
        try:
            return await asyncio.to_thread(fn, *args, **kw)
        except Exception as e:
            raise self._translate(e, what, start=start) from e

    def _translate(self, e: Exception, what: str, *, start: bool) -> EnvPoolError:
        err = ContainerStartError if start else InfraError
        if isinstance(e, self._ApiException):
            status = getattr(e, "status", None)
            reason = getattr(e, "reason", None)
            message = ""
            with contextlib.suppress(TypeError, ValueError):
                body = json.loads(getattr(e, "body", None) or "{}")
                message = str(body.get("message") or "")
                reason = body.get("reason") or reason
            said = f"kubernetes: {what}: {status} {reason}" + (f": {message}" if message else "")
            out: EnvPoolError
            if status == 401:  # the setup's to fix, not a fault to retry with a pod per attempt
                out = EnvUsageError(
                    f"{said}; the API server refused the credentials: renew them (runtime.kubeconfig, "
                    "or the service account's token)"
                )
            elif status == 403 and "exceeded quota" in message:
                # a full ResourceQuota (a 403 too): it frees up as other pods end
                out = err(f"{said}; the namespace's ResourceQuota is full: retried")
            elif status == 403:
                out = EnvUsageError(
                    f"{said}; grant the credentials get, list, create and delete on pods in namespace "
                    f"{self.config.namespace} (a Role and a RoleBinding)"
                )
            else:
                out = err(said)
            vars(out).update(status=status, reason=reason)  # (read by _status_of)
            return out
        # urllib3 errors (connection refused, timeouts) and anything else the client raises
        return err(f"kubernetes: {what}: cannot reach the API server: {type(e).__name__}: {e}")

    @staticmethod
    def _status_of(e: BaseException) -> int | None:
        return getattr(e, "status", None)

    # ------------------------------------------------------------------ pods
    def _command(self, image: str | None) -> list[str]:
        return server_command(self.config, image)

    def _manifest(self, name: str, image: str | None) -> dict[str, Any]:
        cfg = self.config
        resources = {"cpu": f"{max(1, round(cfg.cpu * 1000))}m", "memory": f"{cfg.memory_mb}Mi"}
        annotations = {OWNER_ANNOTATION: self.owner}
        if image is not None:
            annotations[IMAGE_ANNOTATION] = image
        spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "envpool",
                    "image": cfg.image,
                    "command": self._command(image),
                    "ports": [{"containerPort": cfg.port, "protocol": "TCP"}],
                    "resources": {"requests": resources, "limits": resources},
                    "env": [{"name": k, "value": v} for k, v in cfg.env.items()],
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                }
            ],
        }
        if cfg.service_account:
            spec["serviceAccountName"] = cfg.service_account
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": {**cfg.labels, MANAGED_BY[0]: MANAGED_BY[1]},
                "annotations": annotations,
            },
            "spec": spec,
        }

    def _pod_name(self) -> str:
        # 18 characters, a DNS-1123 label: valid as a pod name and as a label value
        return f"envpool-{secrets.token_hex(5)}"

    async def _start(self, image: str | None, bundle: Path | None) -> Container:
        del bundle  # a local path: of no use inside a pod (it fetches by digest instead)
        ns = self.config.namespace
        name = self._pod_name()
        manifest = self._manifest(name, image)
        self._pods.add(name)
        try:
            create = asyncio.ensure_future(
                self._api(
                    self._core.create_namespaced_pod, ns, manifest, what=f"create pod {name}", start=True
                )
            )
            self._creating[name] = create
            create.add_done_callback(lambda t: self._created(name, t))
            # cancelled meanwhile (a start timeout, an aborted claim, a closing pool): the
            # create lands all the same, and the pod is deleted then, as docker and modal do
            try:
                await create_or_clean(create, lambda _: self._delete(name))
            except ContainerStartError as e:
                if self._status_of(e) == 409:
                    # AlreadyExists: that pod is another's (the client never resends a POST,
                    # so it is not our create landing twice): not ours to delete below
                    self._pods.discard(name)
                if self._status_of(e) == 404:  # a create's 404 is its namespace's
                    self._pods.discard(name)
                    raise EnvUsageError(
                        f"kubernetes: namespace {ns!r} not found ({e}); create it, or set runtime.namespace"
                    ) from e
                raise
            pulls = _Pulls()
            host, port = await self._wait_running(name, pulls)
            await self._wait_listening(name, host, port, pulls)
        except BaseException:
            # failed, timed out (cancelled by the base's timeout) or aborted: no pod left behind
            with contextlib.suppress(InfraError):  # still tracked: aclose and the exit hook retry
                await asyncio.shield(self._delete(name))
            raise
        return Container(
            id=name,
            endpoint=f"tcp://{host}:{port}",
            image=image,
            runtime=self.kind,
            isolation="pod",
            handle=name,
        )

    def _created(self, name: str, create: asyncio.Future[Any]) -> None:
        self._creating.pop(name, None)
        if not create.cancelled():
            create.exception()  # read: a start cut off by a second cancellation never awaits it

    async def _wait_running(self, name: str, pulls: _Pulls) -> tuple[str, int]:
        delay = 0.02
        while True:
            pod = await self._api(
                self._core.read_namespaced_pod,
                name,
                self.config.namespace,
                what=f"read pod {name}",
                start=True,
            )
            self._raise_if_failed(pod, pulls)
            status = pod.status
            if status is not None and status.phase == "Running" and status.pod_ip:
                return status.pod_ip, self._port_of(pod)
            self._waiting_for(self._pending(pod, pulls))
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    def _pending(self, pod: Any, pulls: _Pulls) -> str:
        """What a pod that does not run yet waits for, from its status: said by a start
        that times out (an unschedulable pod, a failing pull), with where to look."""
        name = pod.metadata.name
        status = pod.status
        what = f"pod {name} to run"
        if status is not None:
            what += f" (phase {status.phase})"
            for cond in status.conditions or []:
                if cond.type == "PodScheduled" and cond.status == "False":
                    what = f"pod {name} to be scheduled ({cond.reason}: {cond.message})"
            for cs in status.container_statuses or []:
                waiting = cs.state.waiting if cs.state is not None else None
                if waiting is None:
                    continue
                if waiting.reason in _PULL_WAITING:
                    what = (
                        f"pod {name}'s image {cs.image or self.config.image!r} to pull "
                        f"({waiting.reason}: {pulls.cause or waiting.message})"
                    )
                else:
                    what = f"pod {name} ({waiting.reason}: {waiting.message or ''})".replace(": )", ")")
        return f"{what}; see `kubectl -n {self.config.namespace} describe pod {name}`"

    def _raise_if_failed(self, pod: Any, pulls: _Pulls) -> None:
        name = pod.metadata.name
        status = pod.status
        if status is None:
            return
        for cs in status.container_statuses or []:
            state = cs.state
            waiting = state.waiting if state is not None else None
            if waiting is None:
                continue
            image = cs.image or self.config.image
            if waiting.reason in _PULL_WAITING:
                self._check_pull(name, image, waiting.reason, waiting.message or "", pulls)
            elif waiting.reason in _FATAL_WAITING:
                raise ContainerStartError(
                    f"kubernetes: pod {name} cannot start image {image!r}: "
                    f"{waiting.reason}: {waiting.message or ''}".rstrip(": ")
                )
        if status.phase in ("Failed", "Succeeded"):
            detail = status.reason or status.message or ""
            for cs in status.container_statuses or []:
                term = cs.state.terminated if cs.state is not None else None
                if term is not None and term.exit_code == EXIT_IMAGE_NOT_FOUND:
                    image = (pod.metadata.annotations or {}).get(IMAGE_ANNOTATION)
                    raise image_not_found(self.config, image, f"pod {name}")
                if term is not None:
                    detail = (
                        f"exit code {term.exit_code} ({term.reason}): {(term.message or '').strip()[-500:]}"
                    )
            raise ContainerStartError(
                f"kubernetes: pod {name} ended ({status.phase}) before it was ready: {detail}"
            )

    def _check_pull(self, name: str, image: str, reason: str, message: str, pulls: _Pulls) -> None:
        """A failing pull fails the start once it says the image is not to be had, or once
        it has failed for ``image_pull_grace_s``; till then the kubelet's next pull may work."""
        now = time.monotonic()
        if pulls.since is None:
            pulls.since = now
        if message.startswith("Back-off"):
            # ImagePullBackOff's: the cause is ErrImagePull's, which newer kubelets repeat here
            _, said, cause = message.partition("ErrImagePull: ")
            if said:
                pulls.cause = cause
        else:
            pulls.cause = message
        grace = self.config.image_pull_grace_s
        for_good = _PULL_FOR_GOOD.search(pulls.cause) is not None
        if not for_good and now - pulls.since < grace:
            return
        cause = pulls.cause or message
        said = f"kubernetes: pod {name} cannot pull image {image!r}: {reason}: {cause}"
        if for_good:
            # the caller's to fix, as the docker runtime's missing image is: retried, every
            # attempt of every claim (and the prewarm, for as long as the pool ran) made a
            # pod that failed the same way, and the session ended infra_failed, not said
            raise EnvUsageError(
                f"{said}; check runtime.image, and that the nodes may pull it "
                "(runtime.service_account with imagePullSecrets for a private registry)"
            )
        raise ContainerStartError(
            f"{said}; failing for {grace:g} s (runtime.image_pull_grace_s); check the registry is "
            "up and reachable from the cluster's nodes"
        )

    def _port_of(self, pod: Any) -> int:
        annotations = pod.metadata.annotations or {}
        if PORT_ANNOTATION in annotations:
            return int(annotations[PORT_ANNOTATION])
        for c in pod.spec.containers:
            for p in c.ports or []:
                return int(p.container_port)
        return self.config.port

    async def _wait_listening(self, name: str, host: str, port: int, pulls: _Pulls) -> None:
        """Running is not ready: the server may still be fetching its image or importing."""
        self._waiting_for(
            f"pod {name}'s server at {host}:{port} to accept a connection (the pool must reach "
            "pod IPs: run it in the cluster, or where the pod network is routed); see "
            f"`kubectl -n {self.config.namespace} logs {name}`"
        )
        delay = 0.02
        while True:
            if not await _accepts(host, port, 2.0):
                pod = await self._api(
                    self._core.read_namespaced_pod,
                    name,
                    self.config.namespace,
                    what=f"read pod {name}",
                    start=True,
                )
                self._raise_if_failed(pod, pulls)
                await asyncio.sleep(delay)
                delay = min(delay * 1.5, 0.5)
                continue
            return

    async def _delete(self, name: str) -> None:
        if name not in self._pods:
            return  # deleted already (a start given up deletes its pod once it exists)
        if (create := self._creating.get(name)) is not None:
            # a DELETE sent before the create lands answers 404 and the pod appears afterwards:
            # wait for the create (in flight in its thread), the name still tracked meanwhile
            await asyncio.wait([create])
        try:
            await self._api(
                self._core.delete_namespaced_pod,
                name,
                self.config.namespace,
                grace_period_seconds=0,
                what=f"delete pod {name}",
            )
        except InfraError as e:
            if self._status_of(e) != 404:  # already gone is what we wanted
                raise
        self._pods.discard(name)

    async def _stop(self, c: Container) -> None:
        await self._delete(str(c.handle))

    async def _alive(self, c: Container) -> bool:
        try:
            pod = await self._api(
                self._core.read_namespaced_pod,
                str(c.handle),
                self.config.namespace,
                what=f"read pod {c.handle}",
            )
        except InfraError as e:
            if self._status_of(e) == 404:
                return False
            raise
        return pod.status is not None and pod.status.phase == "Running"

    async def reap_orphans(self) -> list[str]:
        """Delete envpool pods whose owner is gone: a process on this host that exited, or
        this runtime's own pods it no longer tracks. Pods of other hosts are left alone (their
        liveness cannot be seen from here). Returns the names deleted."""
        pods = await self._api(
            self._core.list_namespaced_pod,
            self.config.namespace,
            label_selector=f"{MANAGED_BY[0]}={MANAGED_BY[1]}",
            what="list pods",
        )
        reaped = []
        for pod in pods.items:
            name = pod.metadata.name
            owner = (pod.metadata.annotations or {}).get(OWNER_ANNOTATION, "")
            parsed = parse_owner(owner)
            if parsed is None:
                continue  # another host's (or no owner id): not ours to judge
            if owner_is_this_process(owner):
                orphan = parsed[2] == self._instance and name not in self._pods
            else:
                orphan = owner_gone(owner)
            if orphan:
                self._pods.add(name)
                await self._delete(name)
                reaped.append(name)
        self.metrics["reaped_orphans"] += len(reaped)
        return reaped

    async def aclose(self) -> None:
        await super().aclose()
        # starts still in flight delete their own pods; anything else tracked goes now
        await asyncio.gather(*(self._delete(n) for n in list(self._pods)), return_exceptions=True)
        if self._pods:  # a delete failed again: the exit hook tries once more, with this client
            return
        await asyncio.to_thread(self._api_client.close)
        _RUNTIMES.discard(self)
