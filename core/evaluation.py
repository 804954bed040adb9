"""How the policy does on held-out seeds, and on the tasks among them training never saw.

    ev = Evaluator(cfg)
    ev.trained_on(keys)                     # the pretraining corpus's tasks
    ev.trained_on_trajectories(batch)       # each training batch
    row = await ev.run(manager, step, version)

Evaluation seeds start at ``EVAL_SEED_BASE``; training draws below it. A seed is not a task,
though: different seeds can give the same task (4x4 FrozenLake has a few thousand maps, so
100 evaluation seeds give ~81 of them, most of which training meets too). A task is its
reset observation (``task_key``), so every row also says how the policy does on the
evaluation episodes whose task no pretraining or training episode had (``success_unseen``
over ``episodes_unseen``).

An episode that raises (not an environment's or engine's failure, which the manager makes an
``infra_failed`` trajectory, but an error nobody expected) is counted in the row's
``episodes_failed`` and left out of its means; only an evaluation whose every episode raised,
or every greedy or every sampled one, stops the run (``RolloutError``). An evaluation with no
episode to score (every one ``infra_failed``) has ``success`` None, not 0.0: it measured
nothing, and a 0.0 read as a policy that fails every task; it is logged as a warning, and
what reads the rows (the summary, ``best_success``, the plots, the progress line) skips it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any

from core.aio import gather_or_stop
from core.config import JobConfig
from core.errors import DiskFullError, ProxyDiedError, RolloutError
from core.rollout.env_manager import EnvManager, Task, first_observation, task_key
from fabric.protocol import Trajectory

log = logging.getLogger(__name__)

EVAL_SEED_BASE = 10_000_000


#: How many trained tasks' keys are kept before only the evaluation's tasks are (~22 bytes
#: each in every checkpoint's job.json: 50k are ~1.1 MB; a dataset of 200k unique prompts
#: made it 4.4 MB, growing for as long as training met new prompts).
MAX_TRAINED_TASKS = 50_000


class Evaluator:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.rows: list[dict[str, Any]] = []
        #: ``task_key``s of the tasks trained on (pretraining included): all of them up to
        #: ``MAX_TRAINED_TASKS``, then only those among ``eval_tasks`` (``narrowed``)
        self.trained_tasks: set[str] = set()
        #: ``task_key``s of the tasks the evaluations played; None until one has (or in the
        #: job.json of an earlier release, which did not keep them)
        self.eval_tasks: set[str] | None = None
        #: past the cap: ``trained_tasks`` keeps only ``eval_tasks``' keys, which is all the
        #: unseen split asks of it; a task an evaluation meets later is not judged
        self.narrowed = False

    def trained_on(self, keys: Iterable[str]) -> None:
        if self.narrowed:
            assert self.eval_tasks is not None
            self.trained_tasks.update(k for k in keys if k in self.eval_tasks)
            return
        self.trained_tasks.update(keys)
        # the evaluation's tasks are known once one ran (the first, at step 0, before any
        # training); a job that never evaluates needs none of them
        if len(self.trained_tasks) > MAX_TRAINED_TASKS and (
            self.eval_tasks is not None or not self.cfg.rollout.eval_every
        ):
            self._narrow()

    def trained_on_trajectories(self, trajs: Iterable[Trajectory]) -> None:
        self.trained_on(task_keys(trajs))

    def _narrow(self) -> None:
        self.eval_tasks = self.eval_tasks or set()
        self.trained_tasks &= self.eval_tasks
        self.narrowed = True
        log.info(
            "over %d tasks trained on: from now on only the %d evaluation tasks are tracked "
            "(a task an evaluation meets later counts in episodes_untracked)",
            MAX_TRAINED_TASKS,
            len(self.eval_tasks),
        )

    def state(self) -> dict[str, Any]:
        """What a checkpoint's job.json keeps of it (``restore`` reads it back)."""
        return {
            "trained_tasks": sorted(self.trained_tasks),
            "eval_tasks": None if self.eval_tasks is None else sorted(self.eval_tasks),
            "trained_tasks_narrowed": self.narrowed,
        }

    def restore(self, saved: dict[str, Any]) -> None:
        """From ``state()``, or an earlier release's job.json (every trained task, no
        ``eval_tasks``: those are learnt at the next evaluation, and narrowed then)."""
        eval_tasks = saved.get("eval_tasks")
        self.eval_tasks = None if eval_tasks is None else set(eval_tasks)
        self.narrowed = bool(saved.get("trained_tasks_narrowed", False)) and self.eval_tasks is not None
        kept, self.trained_tasks = self.trained_tasks, set()  # added before it: kept too
        self.trained_on(kept | set(saved["trained_tasks"]))

    async def run(self, manager: EnvManager, step: int, version: int) -> dict[str, Any]:
        """Episodes on held-out seeds (the same seeds every time), each seed played greedily
        (``success``) and sampled at the rollout temperature (``success_sampled``): greedy
        shows what the policy prefers, sampled what the rollouts it trains on achieve."""
        cfg = self.cfg
        tasks = []
        for i in range(cfg.rollout.eval_episodes):
            env = cfg.envs[i % len(cfg.envs)]
            for greedy in (True, False):
                tasks.append(Task(env, EVAL_SEED_BASE + i, f"eval-{step}", greedy=greedy))
        te = time.perf_counter()
        trained = set(self.trained_tasks)  # as of this version: training goes on meanwhile
        # past the cap, a task no earlier evaluation played was not tracked: not judged
        tracked = set(self.eval_tasks or ()) if self.narrowed else None
        outcomes = await gather_or_stop(_episode(manager, t, version) for t in tasks)
        failed = [(t, e) for t, e in zip(tasks, outcomes, strict=True) if isinstance(e, BaseException)]
        if failed:
            _say_failed(failed, tasks, step)
        pairs = [(t, tr) for t, tr in zip(tasks, outcomes, strict=True) if isinstance(tr, Trajectory)]
        trajs = [tr for _, tr in pairs]
        played = [v for t in trajs for v in t.policy_versions()]
        # the weights that played it: in async mode the trainer publishes while an
        # evaluation runs (unless rollout.eval_exact), so later versions can take turns
        row: dict[str, Any] = {
            "kind": "eval",
            "step": step,
            "version": version,
            "versions": [min(played), max(played)] if played else [version, version],
        }
        nothing = []
        for greedy, suffix in ((True, ""), (False, "_sampled")):
            mine = [tr for t, tr in pairs if t.greedy is greedy]
            scored = [t for t in mine if t.status in ("ok", "truncated") and t.env_reward is not None]
            if not scored:
                nothing.append((greedy, len(mine)))
            row[f"success{suffix}"] = _success(scored) if scored else None
            row[f"return_mean{suffix}"] = (
                statistics.fmean([t.env_reward or 0.0 for t in scored]) if scored else None
            )
            row[f"episodes{suffix}"] = len(scored)
            keys = [_task_key_of(t) for t in scored]
            judged = [(t, k) for t, k in zip(scored, keys, strict=True) if tracked is None or k in tracked]
            unseen = [t for t, k in judged if k not in trained]
            row[f"success_unseen{suffix}"] = _success(unseen) if unseen else None
            row[f"episodes_unseen{suffix}"] = len(unseen)
            row[f"episodes_untracked{suffix}"] = len(scored) - len(judged)
        row["infra_failed"] = sum(1 for t in trajs if t.status == "infra_failed")
        row["episodes_failed"] = len(failed)
        row["eval_s"] = round(time.perf_counter() - te, 2)
        for greedy, n in nothing:
            log.warning(
                "evaluation at step %d: no %s episode finished to be scored (%d played, %d of them "
                "infra_failed): its success is None, not 0 (see the run's infra errors)",
                step,
                "greedy" if greedy else "sampled",
                n,
                sum(1 for t, tr in pairs if t.greedy is greedy and tr.status == "infra_failed"),
            )
        if not self.narrowed:
            self.eval_tasks = (self.eval_tasks or set()) | set(task_keys(trajs))
            if len(self.trained_tasks) > MAX_TRAINED_TASKS:
                self._narrow()
        self.rows.append(row)
        return row


async def _episode(manager: EnvManager, task: Task, version: int) -> Trajectory | Exception:
    """The episode, or what it raised: an error the manager does not turn into data (its
    own bug, an error of a kind nobody expected) costs this episode, not the evaluation and
    with it the run, as a training trajectory's is counted and re-run (``GroupRunner``). A
    dead proxy or a full disk stops the job, as in training."""
    try:
        return await manager.run(task, version=version)
    except (ProxyDiedError, DiskFullError):
        raise
    except Exception as e:
        return e


def _say_failed(failed: list[tuple[Task, Exception]], tasks: list[Task], step: int) -> None:
    """Log the episodes that raised once, with the first one's traceback; raise when every
    episode did, or every greedy or every sampled one: a bug that fails them all leaves
    nothing to measure, and a row of 0 episodes (its success None, once 0.0, read as a policy
    that fails every task) would hide it until the summary."""
    task, first = failed[0]
    what = f"{type(first).__name__}: {first}"
    total = len(tasks)
    for greedy, kind in ((None, ""), (True, "greedy "), (False, "sampled ")):
        of_kind = sum(1 for t in tasks if greedy is None or t.greedy is greedy)
        raised = [(t, e) for t, e in failed if greedy is None or t.greedy is greedy]
        if of_kind and len(raised) == of_kind:
            t, e = raised[0]
            raise RolloutError(
                f"all {of_kind} {kind}evaluation episodes at step {step} raised (a bug, not a "
                f"transient fault); the first ({t.env.id}, seed {t.seed}): {type(e).__name__}: {e}"
            ) from e
    log.error(
        "evaluation at step %d: %d of %d evaluation episodes raised (counted in the row's "
        "episodes_failed, left out of its success); the first (%s, seed %d): %s",
        step,
        len(failed),
        total,
        task.env.id,
        task.seed,
        what,
        exc_info=first,
    )


def best_success(rows: Iterable[dict[str, Any]]) -> float | None:
    """The best greedy ``success`` of evaluation rows, those with none (no episode to score)
    left out; None when no row has one."""
    return max((r["success"] for r in rows if r.get("success") is not None), default=None)


def _success(trajs: list[Trajectory]) -> float:
    return sum(1 for t in trajs if (t.env_reward or 0) > 0) / max(len(trajs), 1)


def _task_key_of(traj: Trajectory) -> str | None:
    text = first_observation(traj)
    return None if text is None else task_key(text)


def task_keys(trajs: Iterable[Trajectory]) -> Iterator[str]:
    """The ``task_key`` of each trajectory that has a reset observation."""
    return (k for k in map(_task_key_of, trajs) if k is not None)
