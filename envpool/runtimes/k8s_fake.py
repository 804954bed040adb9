"""A fake Kubernetes API server for tests: the real REST protocol for the subset of pods the
``kubernetes`` runtime uses, on 127.0.0.1, in a thread; the official client talks to it
unchanged.

    with FakeKubernetesAPI() as api:
        EnvPool({"runtime": {"type": "kubernetes", "host": api.url}})

Served: ``POST/GET(list)/GET/DELETE /api/v1/namespaces/{ns}/pods[/{name}]`` with Pod,
PodList and Status bodies shaped like the real ones (404 NotFound, 409 AlreadyExists, 422
Invalid: a pod name or label the real server refuses). Every created pod really runs: its
container's command starts here as a process (``python`` is this interpreter; a
``0.0.0.0:<port>`` listen address becomes ``127.0.0.1:0``). The pod is Pending until the
process prints its JSON ready line, then Running with ``podIP`` 127.0.0.1 and the port it
bound in the ``envpool.dev/port`` annotation; Failed (with the process's stderr tail as the
termination message) if the process exits. DELETE kills the process. Closing the fake kills
every process it started.

Knobs: ``fail_next_create`` (HTTP statuses the next creates answer, e.g. ``[500]`` or
``[409]``), ``fail_next_delete`` (the same for deletes), ``image_pull_error_for`` (images
whose pods stay Pending in ErrImagePull: not found) and ``image_pull_flaky`` (images whose
pulls fail that many times first, a registry hiccup: the pod goes ErrImagePull, then
ImagePullBackOff while the kubelet backs off, ``pull_backoff_s``, then pulls again);
``unschedulable`` keeps every new pod Pending, unscheduled, with the scheduler's message.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from envpool.runtimes.base import k8s_label_problem

PORT_ANNOTATION = "envpool.dev/port"
_POD_PATH = re.compile(r"^/api/v1/namespaces/(?P<ns>[a-z0-9-]+)/pods(?:/(?P<name>[^/]+))?$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "AlreadyExists",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _status(code: int, message: str, *, name: str | None = None) -> dict[str, Any]:
    """A ``Status`` object, as the API server answers errors."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": _REASONS.get(code, "Unknown"),
        "code": code,
    }
    if name is not None:
        body["details"] = {"name": name, "kind": "pods"}
    return body


def _matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class _Pod:
    def __init__(self, obj: dict[str, Any]):
        self.obj = obj
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr: Path | None = None
        self.deleted = False


class FakeKubernetesAPI:
    def __init__(self) -> None:
        self.fail_next_create: list[int | tuple[int, str]] = []
        """HTTP statuses for the next pod creates, in order (500 InternalError, 409 AlreadyExists...),
        each alone or with the Status message the server gives."""
        self.fail_next_delete: list[int] = []
        """HTTP statuses for the next pod deletes, in order (the pod stays)."""
        self.image_pull_error_for: set[str] = set()
        """Images whose pods never start: Pending, container waiting in ErrImagePull."""
        self.image_pull_flaky: dict[str, int] = {}
        """Image -> how many of each pod's pulls fail (a registry's 503) before one succeeds."""
        self.pull_backoff_s = 0.2
        """The kubelet's back-off between pulls (10 s, doubling, on a real node)."""
        self.unschedulable: str | None = None
        """The scheduler's message while no node fits a pod (they stay Pending, PodScheduled
        False, Unschedulable), e.g. ``"0/3 nodes are available: 3 Insufficient cpu."``."""
        self.requests: Counter[str] = Counter()
        """``"POST pods"``, ``"GET pod"``, ``"LIST pods"``, ``"DELETE pod"``: what the client did."""
        self.authorization: str | None = None
        """The ``Authorization`` header of the last request (the fake checks none)."""
        self._pods: dict[tuple[str, str], _Pod] = {}
        self._lock = threading.Lock()
        self._version = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._tmp = Path(tempfile.mkdtemp(prefix="envpool-k8s-fake-"))

    # -- lifecycle
    def __enter__(self) -> FakeKubernetesAPI:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        api = self

        class Handler(_Handler):
            fake = api

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="k8s-fake", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            pods = list(self._pods.values())
            self._pods.clear()
            for pod in pods:
                pod.deleted = True  # (a pull under way starts no process for it now)
        for pod in pods:
            self._kill(pod)
        import shutil

        shutil.rmtree(self._tmp, ignore_errors=True)

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeKubernetesAPI is not running: use `with FakeKubernetesAPI() as api:`")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # -- for tests
    def pod_names(self, namespace: str = "default") -> list[str]:
        with self._lock:
            return sorted(name for ns, name in self._pods if ns == namespace)

    def pod(self, name: str, namespace: str = "default") -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._pods[(namespace, name)].obj)

    def pid(self, name: str, namespace: str = "default") -> int | None:
        with self._lock:
            proc = self._pods[(namespace, name)].proc
        return proc.pid if proc is not None else None

    def kill(self, name: str, namespace: str = "default") -> None:
        """Kill a pod's process behind its owner's back (the pod turns Failed)."""
        with self._lock:
            pod = self._pods[(namespace, name)]
        if pod.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.proc.pid, signal.SIGKILL)
            pod.proc.wait()

    def processes(self) -> list[int]:
        """Pids of the pod processes still running."""
        with self._lock:
            procs = [p.proc for p in self._pods.values() if p.proc is not None]
        return [p.pid for p in procs if p.poll() is None]

    # -- the API
    def create(self, ns: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.requests["POST pods"] += 1
        meta = body.get("metadata") or {}
        name = str(meta.get("name") or "")
        with self._lock:
            if self.fail_next_create:
                fail = self.fail_next_create.pop(0)
                code, message = (
                    fail if isinstance(fail, tuple) else (fail, f"injected failure creating pod {name!r}")
                )
                return code, _status(code, message, name=name)
        if body.get("kind", "Pod") != "Pod" or not (body.get("spec") or {}).get("containers"):
            return 422, _status(422, f'Pod "{name}" is invalid: spec.containers: Required value', name=name)
        if not _DNS1123.match(name) or len(name) > 253:
            return 422, _status(422, f'Pod "{name}" is invalid: metadata.name: Invalid value', name=name)
        for key, value in (meta.get("labels") or {}).items():
            if (problem := k8s_label_problem(str(key), str(value))) is not None:
                return 422, _status(
                    422, f'Pod "{name}" is invalid: metadata.labels: Invalid value: {problem}', name=name
                )
        if meta.get("namespace") not in (None, ns):
            return 400, _status(400, "the namespace of the provided object does not match the request")
        obj = copy.deepcopy(body)
        obj.setdefault("apiVersion", "v1")
        obj.setdefault("kind", "Pod")
        container = obj["spec"]["containers"][0]
        with self._lock:
            if (ns, name) in self._pods:
                return 409, _status(409, f'pods "{name}" already exists', name=name)
            self._version += 1
            obj["metadata"].update(
                namespace=ns,
                uid=str(uuid.uuid4()),
                resourceVersion=str(self._version),
                creationTimestamp=_now(),
            )
            obj["metadata"].setdefault("annotations", {})
            obj["metadata"].setdefault("labels", {})
            obj["status"] = {"phase": "Pending", "qosClass": "Guaranteed", "startTime": _now()}
            pod = _Pod(obj)
            self._pods[(ns, name)] = pod
            if self.unschedulable is not None:
                obj["status"]["conditions"] = [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": self.unschedulable,
                        "lastTransitionTime": _now(),
                    }
                ]
                return 201, copy.deepcopy(obj)
            if container.get("image") in self.image_pull_error_for:
                obj["status"]["containerStatuses"] = [
                    self._container_status(
                        container,
                        {
                            "waiting": {
                                "reason": "ErrImagePull",
                                "message": f"rpc error: code = NotFound desc = failed to pull image"
                                f" {container['image']!r}: not found",
                            }
                        },
                    )
                ]
                return 201, copy.deepcopy(obj)
            created = copy.deepcopy(obj)
            failures = self.image_pull_flaky.get(container.get("image", ""), 0)
        if failures:
            threading.Thread(target=self._pull, args=(pod, container, failures), daemon=True).start()
        else:
            self._run(pod, container)
        return 201, created

    def get(self, ns: str, name: str) -> tuple[int, dict[str, Any]]:
        self.requests["GET pod"] += 1
        with self._lock:
            pod = self._pods.get((ns, name))
            if pod is None:
                return 404, _status(404, f'pods "{name}" not found', name=name)
            return 200, copy.deepcopy(pod.obj)

    def list(self, ns: str, selector: str) -> tuple[int, dict[str, Any]]:
        self.requests["LIST pods"] += 1
        with self._lock:
            items = [
                copy.deepcopy(p.obj)
                for (pns, _), p in sorted(self._pods.items())
                if pns == ns and _matches(p.obj["metadata"].get("labels") or {}, selector)
            ]
            version = str(self._version)
        return 200, {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": version},
            "items": items,
        }

    def delete(self, ns: str, name: str) -> tuple[int, dict[str, Any]]:
        self.requests["DELETE pod"] += 1
        with self._lock:
            if self.fail_next_delete:
                code = self.fail_next_delete.pop(0)
                return code, _status(code, f"injected failure deleting pod {name!r}", name=name)
            pod = self._pods.pop((ns, name), None)
            if pod is None:
                return 404, _status(404, f'pods "{name}" not found', name=name)
            pod.deleted = True
            pod.obj["metadata"]["deletionTimestamp"] = _now()
            pod.obj["metadata"]["deletionGracePeriodSeconds"] = 0
            obj = copy.deepcopy(pod.obj)
        self._kill(pod)
        return 200, obj

    # -- pods as processes
    @staticmethod
    def _container_status(
        container: dict[str, Any], state: dict[str, Any], *, ready: bool = False
    ) -> dict[str, Any]:
        return {
            "name": container.get("name", "c"),
            "image": container.get("image", ""),
            "imageID": "",
            "ready": ready,
            "restartCount": 0,
            "started": ready,
            "state": state,
        }

    def _pull(self, pod: _Pod, container: dict[str, Any], failures: int) -> None:
        """The kubelet's pulls of a flaky registry: each failure is ErrImagePull, then
        ImagePullBackOff for the back-off, then the next pull; the pod runs after them."""
        image = container.get("image", "")
        for _ in range(failures):
            for reason, message, pause in (
                (
                    "ErrImagePull",
                    f'failed to pull and unpack image "{image}": failed to resolve reference '
                    f'"{image}": unexpected status from HEAD request: 503 Service Unavailable',
                    self.pull_backoff_s / 4,
                ),
                ("ImagePullBackOff", f'Back-off pulling image "{image}"', self.pull_backoff_s),
            ):
                with self._lock:
                    if pod.deleted:
                        return
                    waiting = {"waiting": {"reason": reason, "message": message}}
                    pod.obj["status"]["containerStatuses"] = [self._container_status(container, waiting)]
                time.sleep(pause)
        with self._lock:
            if pod.deleted:
                return
            pod.obj["status"].pop("containerStatuses", None)
        self._run(pod, container)
        with self._lock:
            gone = pod.deleted  # deleted (or the fake closed) while it started: nothing else kills it
        if gone:
            self._kill(pod)

    def _run(self, pod: _Pod, container: dict[str, Any]) -> None:
        cmd = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
        if cmd and cmd[0] in ("python", "python3"):
            cmd[0] = sys.executable
        # the pod's own network would give it the port it asked for; here they all share one
        cmd = [re.sub(r"^0\.0\.0\.0:\d+$", "127.0.0.1:0", a) for a in cmd]
        if "envpool.server" in cmd:
            cmd += ["--parent-pid", str(os.getpid())]  # never outlive the test run
        # a pod's /tmp is its own and goes with it: here a dir of the fake's, removed at close
        # (the server's image fetch unpacked into the host's /tmp and left it there)
        tmp = self._tmp / f"{pod.obj['metadata']['name']}.tmp"
        tmp.mkdir(exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "TMPDIR": str(tmp)}
        env.update({e["name"]: str(e.get("value", "")) for e in container.get("env") or []})
        pod.stderr = self._tmp / f"{pod.obj['metadata']['name']}.stderr"
        with open(pod.stderr, "wb") as err:
            pod.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                cwd=self._tmp,
                start_new_session=True,
            )
        threading.Thread(target=self._watch, args=(pod, container), daemon=True).start()

    def _watch(self, pod: _Pod, container: dict[str, Any]) -> None:
        proc = pod.proc
        assert proc is not None and proc.stdout is not None
        for line in proc.stdout:
            with contextlib.suppress(ValueError):
                info = json.loads(line)
                if isinstance(info, dict) and info.get("ready"):
                    port = str(info["endpoint"]).rpartition(":")[2]
                    with self._lock:
                        pod.obj["metadata"]["annotations"][PORT_ANNOTATION] = port
                        started = {"running": {"startedAt": _now()}}
                        pod.obj["status"].update(
                            phase="Running",
                            podIP="127.0.0.1",
                            podIPs=[{"ip": "127.0.0.1"}],
                            hostIP="127.0.0.1",
                            containerStatuses=[self._container_status(container, started, ready=True)],
                        )
                    break
        code = proc.wait()
        proc.stdout.close()
        tail = ""
        with contextlib.suppress(OSError):
            tail = pod.stderr.read_bytes()[-2000:].decode(errors="replace") if pod.stderr else ""
        with self._lock:
            if pod.deleted:
                return
            terminated = {
                "terminated": {
                    "exitCode": code if code >= 0 else 128 - code,
                    "reason": "Completed" if code == 0 else "Error",
                    "message": tail,
                    "finishedAt": _now(),
                }
            }
            pod.obj["status"].update(
                phase="Succeeded" if code == 0 else "Failed",
                containerStatuses=[self._container_status(container, terminated)],
            )

    def _kill(self, pod: _Pod) -> None:
        if pod.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pod.proc.pid, signal.SIGKILL)
            pod.proc.wait()


class _Handler(BaseHTTPRequestHandler):
    fake: FakeKubernetesAPI
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no access log: a line per request on stderr is noise in every test

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw else {}

    def _route(self, method: str) -> None:
        self.fake.authorization = self.headers.get("Authorization")
        url = urlsplit(self.path)
        m = _POD_PATH.match(url.path)
        try:
            body = self._body()
        except ValueError as e:
            self._reply(400, _status(400, f"the request body is not JSON: {e}"))
            return
        if m is None:
            self._reply(404, _status(404, "the server could not find the requested resource"))
            return
        ns, name = m["ns"], m["name"]
        fake = self.fake
        if method == "POST" and name is None:
            code, out = fake.create(ns, body)
        elif method == "GET" and name is None:
            selector = (parse_qs(url.query).get("labelSelector") or [""])[0]
            code, out = fake.list(ns, selector)
        elif method == "GET":
            code, out = fake.get(ns, name)
        elif method == "DELETE" and name is not None:
            code, out = fake.delete(ns, name)
        else:
            code, out = 405, _status(405, f"{method} is not supported here")
        self._reply(code, out)

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_DELETE(self) -> None:
        self._route("DELETE")
