"""An image's envpool.json: what a bundle registers, found in a child process as a container
loads it; every way a manifest can be wrong is one ManifestError saying what to fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import envpool
from envpool.manifest import ManifestError, read_manifest, registered_by
from envpool.server import load_bundle

COIN = """
import envpool


class Coin(envpool.Env):
    example_actions = ("heads", "tails")

    def reset(self, *, seed=None, options=None):
        print("a module that prints to stdout")  # must not garble the child's answer
        return "Call the coin: heads or tails.", {}

    def step(self, action):
        reward = float(action.strip() == "heads")
        return envpool.StepResult(obs=envpool.Observation(text="done"), reward=reward, terminated=True)
"""


def image(tmp_path: Path, manifest: object, *, register: bool = True, name: str = "img") -> Path:
    root = tmp_path / name
    root.mkdir()
    (root / "manifest_coin.py").write_text(
        COIN
        + ('\nenvpool.register("manifest-coin-v0", entry_point="manifest_coin:Coin", max_episode_steps=2)\n')
        if register
        else COIN
    )
    if manifest is not None:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        (root / "envpool.json").write_text(text)
    return root


def test_the_modules_an_image_names_register_its_environments_in_a_child(tmp_path):
    root = image(tmp_path, {"modules": ["manifest_coin"]})
    envs = registered_by(root)
    assert list(envs) == ["manifest-coin-v0"]  # the built-ins are not the image's
    assert envs["manifest-coin-v0"]["entry_point"] == "manifest_coin:Coin"
    assert envs["manifest-coin-v0"]["max_episode_steps"] == 2
    # nothing of the image ran here
    assert "manifest-coin-v0" not in envpool.default_registry and "manifest_coin" not in sys.modules


HELPER = """
import os, subprocess, sys
# a simulator the module starts at import; it inherits the child's stdout and stderr
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(os.environ["HELPER_PID_FILE"], "w") as f:
    f.write(str(helper.pid))
"""


def test_a_helper_an_image_starts_at_import_neither_holds_up_the_check_nor_outlives_it(tmp_path, monkeypatch):
    # the check waited for EOF on pipes the helper held: the full timeout, then "loading it
    # took over 120 s", and the helper left running
    root = image(tmp_path, {"modules": ["manifest_coin", "helper"]})
    (root / "helper.py").write_text(HELPER)
    pid_file = tmp_path / "helper.pid"
    monkeypatch.setenv("HELPER_PID_FILE", str(pid_file))
    t0 = time.monotonic()
    assert list(registered_by(root, timeout_s=20)) == ["manifest-coin-v0"]
    assert time.monotonic() - t0 < 15
    helper = int(pid_file.read_text())
    deadline = time.monotonic() + 5  # killed at once; a zombie until its new parent reaps it
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(helper), "the image's helper outlived the check"


HANGS = """
import os, time
with open(os.environ["CHILD_PID_FILE"] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(os.environ["CHILD_PID_FILE"] + ".tmp", os.environ["CHILD_PID_FILE"])
time.sleep(60)  # an import that hangs (up to the check's timeout)
"""


def test_a_driver_killed_while_it_inspects_an_image_leaves_no_child(tmp_path):
    # the child leads a process group of its own, which the driver kills when the check
    # ends: a driver SIGKILLed (or dead of OOM) ran no such end, and the child ran on
    root = image(tmp_path, {"modules": ["hangs"]})
    (root / "hangs.py").write_text(HANGS)
    pid_file = tmp_path / "child.pid"
    code = "import sys; from envpool.manifest import registered_by; registered_by(sys.argv[1])"
    env = {**os.environ, "CHILD_PID_FILE": str(pid_file), "PYTHONPATH": os.pathsep.join(sys.path)}
    driver = subprocess.Popen([sys.executable, "-c", code, str(root)], env=env)
    child = 0
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists():
            assert time.monotonic() < deadline and driver.poll() is None
            time.sleep(0.01)
        child = int(pid_file.read_text())
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _alive(child), "the inspection's child outlived its driver"
    finally:
        driver.kill()
        driver.wait()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_inspecting_an_image_leaves_its_directory_and_digest_unchanged(tmp_path, monkeypatch):
    from envpool.images import build_bundle

    # the child's import wrote __pycache__/*.pyc into the image, which the bundle then packed
    # (this sandbox sets PYTHONDONTWRITEBYTECODE, which hid it)
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    root = image(tmp_path, {"modules": ["manifest_coin"]})
    before = build_bundle(root).digest
    registered_by(root)
    assert sorted(p.name for p in root.rglob("*")) == ["envpool.json", "manifest_coin.py"]
    assert build_bundle(root).digest == before


def test_a_bundle_leaves_out_bytecode_caches(tmp_path):
    from envpool.images import build_bundle

    root = image(tmp_path, {"modules": ["manifest_coin"]})
    before = build_bundle(root).digest
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "manifest_coin.cpython-312.pyc").write_bytes(b"\0")
    (root / "stray.pyc").write_bytes(b"\0")
    assert build_bundle(root).digest == before


def test_register_entries_are_checked_too(tmp_path):
    root = image(
        tmp_path,
        {"register": [{"id": "listed-coin-v0", "entry_point": "manifest_coin:Coin", "deterministic": False}]},
        register=False,
    )
    envs = registered_by(root)
    assert list(envs) == ["listed-coin-v0"] and envs["listed-coin-v0"]["deterministic"] is False


@pytest.mark.parametrize(
    ("manifest", "register", "says"),
    [
        (None, True, "has no envpool.json: add one naming what the image registers"),
        ('{"modules": ["manifest_coin"]', True, "envpool.json is not valid JSON"),
        ({"module": ["manifest_coin"]}, True, "envpool.json: module: Extra inputs are not permitted"),
        ({"modules": "manifest_coin"}, True, "envpool.json: modules: Input should be a valid list"),
        (
            {"modules": ["manifest_coin", "no_such_module_abc"]},
            True,
            "modules[1] 'no_such_module_abc' does not import: ModuleNotFoundError",
        ),
        (
            {"register": [{"id": "typo-coin-v0", "entry_point": "manifest_coin:Coinn"}]},
            False,
            "'typo-coin-v0' has the entry point 'manifest_coin:Coinn', which does not load",
        ),
        (
            {"register": [{"id": "bad id", "entry_point": "manifest_coin:Coin"}]},
            False,
            "register[0]: EnvRegistryError: bad registration of 'bad id'",
        ),
    ],
    ids=["missing", "not-json", "unknown-key", "not-a-list", "import-error", "entry-point-typo", "bad-id"],
)
def test_a_bad_manifest_is_one_error_saying_what_to_fix(tmp_path, manifest, register, says):
    root = image(tmp_path, manifest, register=register)
    with pytest.raises(ManifestError) as e:
        registered_by(root)
    assert says in str(e.value)
    assert "Traceback" not in str(e.value)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'\xff{"modules": ["manifest_coin"]}', "envpool.json is not valid JSON"),
        (b"[" * 100_000, "envpool.json is not valid JSON: nested too deeply"),
    ],
    ids=["not-utf8", "too-deep"],
)
def test_a_manifest_of_bad_bytes_is_a_manifest_error(tmp_path, content, says):
    # before: a bare UnicodeDecodeError or RecursionError, which the job's config check
    # (core.env_images) let through as a crash instead of a problem of envs[i].image
    root = image(tmp_path, None)
    (root / "envpool.json").write_bytes(content)
    with pytest.raises(ManifestError, match=says):
        read_manifest(root)
    with pytest.raises(ManifestError, match=says):
        registered_by(root)


def test_an_image_that_redefines_a_built_in_is_refused(tmp_path):
    root = image(tmp_path, {"register": [{"id": "frozenlake-v1", "entry_point": "manifest_coin:Coin"}]})
    with pytest.raises(ManifestError, match=r"already registered to envpool\.envs\.frozenlake:FrozenLakeEnv"):
        registered_by(root)


def test_a_container_names_the_manifest_entry_that_fails(tmp_path):
    # the server loads an image with the same code: the entry is named there too
    root = image(tmp_path, {"modules": ["no_such_module_abc"]})
    with pytest.raises(ManifestError, match=r"modules\[0\] 'no_such_module_abc' does not import"):
        load_bundle(root)
    sys.path.remove(str(root))


def test_read_manifest_takes_both_forms(tmp_path):
    m = read_manifest(image(tmp_path, {"modules": ["a"], "register": [{"id": "x-v0", "entry_point": "a:X"}]}))
    assert m.modules == ["a"] and m.entries == [{"id": "x-v0", "entry_point": "a:X"}]
