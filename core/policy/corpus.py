"""The tokenizer's training text: seeded random episodes of the job's environments, played
outside the driver.

Environment code never runs in the driver: an environment may kill its process on purpose
(``latency-v0`` models a container dying with ``os._exit``), run model-written code
(``code-repair-v1``) or hang. One child process per environment builds it once, then forks
a grandchild per episode (cheap: the child holds no threads, no Ray, no torch), up to
``PARALLEL`` at once, that plays it and leaves its texts in a file; the child prints them,
one JSON line per episode, in seed order. An episode that kills or hangs its grandchild is skipped and
reported; one that all episodes fail, or an environment that cannot be built, is a
``ConfigError`` naming the environment.

The child runs in a session of its own, so that stopping it (its time is up, or the caller's
``stop`` flag is set: the job was interrupted) kills its episodes' processes with it, and
the files they write go to a directory the driver owns and removes, whatever happened.

    texts = env_corpus(cfg)             # list[str], deterministic for a config
    played = play_envs(cfg, episodes)   # the episodes too: observations and the actions
                                        # between them (what pretraining learns from)

``python -m core.policy.corpus`` is the child (a JSON spec on stdin).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import ConfigError, StoppedError

if TYPE_CHECKING:  # the child (``python -m core.policy.corpus``) needs no config: it is
    # started at every job's start, and the config's import was half its CPU time
    from core.config import JobConfig

log = logging.getLogger(__name__)

CORPUS_EPISODES = 200
CORPUS_TURNS = 12
#: One episode's wall-clock limit (SIGALRM in its own process), and the child's in all.
EPISODE_TIMEOUT_S = 10
CHILD_TIMEOUT_S = 300.0
#: Episodes played at once.
PARALLEL = 64
#: How often the driver looks at its ``stop`` flag while the child plays.
POLL_S = 0.1


@dataclass(frozen=True)
class Episode:
    """One random-play episode: ``texts[0]`` is the reset observation, ``texts[k + 1]`` the
    observation after ``actions[k]``."""

    env: int
    """Index into ``cfg.envs``."""
    texts: list[str]
    actions: list[str]


@dataclass
class Played:
    texts: list[str] = field(default_factory=list)
    """The tokenizer's corpus: action words, system prompts, every observation."""
    episodes: list[Episode] = field(default_factory=list)


def env_corpus(
    cfg: JobConfig, episodes: int = CORPUS_EPISODES, *, bundles: dict[str, Path] | None = None
) -> list[str]:
    """Text of seeded random episodes of every configured environment: the action words,
    the system prompt, observations and invalid-action messages."""
    return play_envs(cfg, episodes, bundles=bundles).texts


def play_envs(
    cfg: JobConfig,
    episodes: int = CORPUS_EPISODES,
    *,
    stop: threading.Event | None = None,
    bundles: dict[str, Path] | None = None,
) -> Played:
    """``episodes`` seeded random episodes of every configured environment, in seed order.
    Raises ``StoppedError`` soon after ``stop`` is set (the children killed). An entry with
    an ``image`` is played from its unpacked bundle (``bundles[env.image]``, what the job's
    ``JobImages`` unpacked), loaded as a container loads it."""
    played = Played()
    for i, env_cfg in enumerate(cfg.envs):
        bundle = None
        if env_cfg.image is not None:
            bundle = (bundles or {}).get(env_cfg.image)
            if bundle is None:
                raise ConfigError(
                    [(f"envs[{i}].image", f"no unpacked bundle of {env_cfg.image} given to play it from")]
                )
        spec = {
            "id": env_cfg.id,
            "bundle": str(bundle) if bundle is not None else None,
            "kwargs": env_cfg.kwargs,
            "actions": env_cfg.actions,
            "salt": f"{cfg.seed}-{i}",
            "episodes": episodes,
            "episode_timeout_s": EPISODE_TIMEOUT_S,
            "parallel": PARALLEL,
        }
        if env_cfg.prompt.system:
            played.texts.append(env_cfg.prompt.system)
        _play(spec, where=f"envs[{i}]", env=i, into=played, stop=stop)
    return played


def _play(
    spec: dict[str, Any], *, where: str, env: int, into: Played, stop: threading.Event | None = None
) -> None:
    """``where``: the entry's key (``envs[0]``); a problem names its ``.id``, or ``.kwargs``
    when the environment would not take them."""

    def refuse(why: str, key: str = "id") -> ConfigError:
        return ConfigError([(f"{where}.{key}", f"cannot play {spec['id']} to build the tokenizer: {why}")])

    try:
        returncode, stdout, stderr = _run_child(spec, stop)
    except subprocess.TimeoutExpired:
        raise refuse(f"{spec['episodes']} episodes took over {CHILD_TIMEOUT_S:.0f} s") from None
    if returncode != 0:
        refused = _kwargs_refused(stdout)
        if refused is not None:
            how = "does not take" if refused.startswith("TypeError") else "refused"
            raise refuse(f"it {how} kwargs {spec['kwargs']}: {refused}", "kwargs")
        raise refuse(_last_line(stderr) or f"exit code {returncode}")
    texts = into.texts
    played, died = 0, []
    for line in stdout.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # not a protocol line (cannot happen: the child moved stdout to stderr)
        if "actions" in row:
            texts.append(" ".join(row["actions"]))
        elif "died" in row:
            died.append(f"seed {row['seed']}: {row['died']}")
        else:
            texts += row["texts"]
            into.episodes.append(Episode(env, row["texts"], row["taken"]))
            played += 1
    if played == 0:
        raise refuse(f"every episode failed ({died[0] if died else 'no output'})")
    if died:
        n = spec["episodes"]
        log.info("%s: %d of %d corpus episodes failed and were skipped (%s)", where, len(died), n, died[0])


def _run_child(spec: dict[str, Any], stop: threading.Event | None) -> tuple[int, str, str]:
    """The child's (exit code, stdout, stderr). Raises ``TimeoutExpired`` after
    ``CHILD_TIMEOUT_S`` and ``StoppedError`` once ``stop`` is set, with the child's whole
    session killed either way (its episodes' processes too: killing the child alone left
    them playing on) and the episodes' directory removed. The child's output goes to files
    and its own exit ends the wait: an environment that starts a helper process (a
    simulator, a game server) hands it the child's output, and waiting for EOF on pipes
    waited for the helper, up to the whole timeout."""
    from envpool.manifest import wait_unreaped

    with (
        tempfile.TemporaryDirectory(prefix="rl-fabric-corpus-", ignore_cleanup_errors=True) as tmp,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.TemporaryFile() as inp,
    ):
        inp.write(json.dumps({**spec, "tmp": tmp}).encode())
        inp.seek(0)
        proc = subprocess.Popen(
            [sys.executable, "-m", "core.policy.corpus"],
            stdin=inp,
            stdout=out,
            stderr=err,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            start_new_session=True,  # its own process group: one killpg stops all of it
        )
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        try:
            while not wait_unreaped(proc.pid, POLL_S):
                if stop is not None and stop.is_set():
                    raise StoppedError(f"stopped while playing {spec['id']} for the tokenizer corpus")
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(proc.args, CHILD_TIMEOUT_S)
        finally:
            # exited or not, before it is reaped: its group's id is nobody else's until then
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        return (
            proc.returncode,
            out.read().decode("utf-8", errors="replace"),
            err.read().decode("utf-8", errors="replace"),
        )


def _kwargs_refused(stdout: str) -> str | None:
    """The child's ``kwargs_refused`` line, if it wrote one before it failed."""
    for line in stdout.splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if isinstance(row, dict) and "kwargs_refused" in row:
                return str(row["kwargs_refused"])
    return None


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def _child(spec: dict[str, Any]) -> None:
    """Build the environment, then play each episode in a forked process of its own, up to
    ``parallel`` at once (an environment's steps often wait: a tool, a simulator, a sleep)."""
    from envpool.server import load_bundle

    out = os.dup(1)
    os.dup2(2, 1)  # whatever the environment prints goes to stderr, not into the protocol
    bundle = Path(spec["bundle"]).absolute() if spec.get("bundle") else None
    if bundle is not None:
        os.chdir(bundle)  # as in a container: the image's directory is the working directory
    registry = load_bundle(bundle)  # the built-ins and what the image registers
    try:
        env = registry.make(spec["id"], tool_caller=_no_tools, **spec["kwargs"])
    except (TypeError, ValueError) as e:
        if not spec["kwargs"]:
            raise
        # the constructor would not take the entry's kwargs (a typo, a key it never had, a
        # value out of range): said as such, the problem names envs[i].kwargs, not the id
        # that is right
        _write(out, {"kwargs_refused": f"{type(e).__name__}: {e}"})
        raise
    actions = list(spec["actions"] or env.env.example_actions or ("noop",))
    _write(out, {"actions": actions})
    n = spec["episodes"]
    seeds = iter(range(n))
    running: dict[int, int] = {}  # pid -> seed
    rows: dict[int, dict[str, Any]] = {}
    # the driver's directory (it removes it, even after killing this process), or our own
    given = spec.get("tmp")
    where = (
        contextlib.nullcontext(given) if given else tempfile.TemporaryDirectory(prefix="rl-fabric-corpus-")
    )
    with where as tmp:

        def start(seed: int) -> None:
            pid = os.fork()
            if pid == 0:
                # what the episode puts in the temp dir (code-repair's work dir) goes with
                # ours, even when the alarm or a stop kills it before its close
                tempfile.tempdir = tmp
                signal.alarm(spec["episode_timeout_s"])
                try:
                    texts, taken = _episode(env, actions, seed, spec["salt"])
                    row = {"seed": seed, "texts": texts, "taken": taken}
                except Exception as e:  # the environment's own bug: reported, not fatal
                    row = {"seed": seed, "died": f"{type(e).__name__}: {e}"}
                finally:
                    with contextlib.suppress(Exception):  # os._exit runs no cleanup of its own
                        env.close()
                with open(os.path.join(tmp, f"{seed}.json"), "w") as f:
                    json.dump(row, f)
                os._exit(0)
            running[pid] = seed

        for seed in itertools.islice(seeds, spec["parallel"]):
            start(seed)
        while running:
            pid, status = os.waitpid(-1, 0)
            seed = running.pop(pid, -1)
            if seed < 0:
                continue  # a process the environment started itself
            rows[seed] = _result(tmp, seed, os.waitstatus_to_exitcode(status))
            nxt = next(seeds, None)
            if nxt is not None:
                start(nxt)
    for seed in range(n):  # in seed order: the corpus does not depend on who finished first
        _write(out, rows[seed])


def _result(tmp: str, seed: int, code: int) -> dict[str, Any]:
    if code == 0:
        try:
            with open(os.path.join(tmp, f"{seed}.json")) as f:
                row: dict[str, Any] = json.load(f)
            return row
        except (OSError, json.JSONDecodeError):
            pass  # exited 0 without a whole file (killed between write and exit): it died
    why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    return {"seed": seed, "died": why}


def _episode(env: Any, actions: list[str], seed: int, salt: str) -> tuple[list[str], list[str]]:
    rng = random.Random(f"{salt}-{seed}")
    obs, _ = env.reset(seed=seed)
    texts, taken = [obs.text], []
    for _ in range(CORPUS_TURNS):
        action = rng.choice(actions)
        res = env.step(action)
        texts.append(res.obs.text)
        taken.append(action)
        if res.done:
            break
    return texts, taken


def _write(fd: int, row: dict[str, Any]) -> None:
    data = (json.dumps(row) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def _no_tools(name: str, arguments: dict[str, Any]) -> str:
    return f"{name} output"


if __name__ == "__main__":
    _child(json.loads(sys.stdin.read()))
